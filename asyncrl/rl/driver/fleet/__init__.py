"""The driver's fleet: the actors it drives besides itself, and one owner of their state.

    calls.py          call_all: one call to many actors at once, each within its deadline, every
                      answer awaited, the failures handed back with causes that name the call
    membership.py     Membership: the one writer of each sampler's state (joined, lost, gone,
                      drained; its incarnation, data walk, pump), its losses and returns, and
                      call_all over members (the calls pinned to the incarnations that joined,
                      the ones that failed lost in one place)
    sync_group.py     SyncGroup: the weight-sync group's group-wide calls, the trainer's verdict
    pool.py           SamplerPool: the loop's view of the samplers (batches, syncs, checks,
                      data positions), their pumps started and judged, recovery
    pumps.py          Pumps: a sampler's rollout streams into the queue (paced, in the order
                      the groups end)
    decoding.py       while_decoding: a sampler's stream waited on for as long as it decodes
                      (--run.generate_timeout_s bounds the time with no item and no token)
    scaling.py        Scaler: samplers added and drained mid-run (``asyncrl scale``)
    endpoints.py      sampler_endpoints: each sampler's OpenAI endpoint and token, for code
                      outside the episodes (``asyncrl status RUN_DIR --endpoint``)
    sampler_start.py  the samplers' start, which survives one that never comes up
    trainer_ranks.py  the trainer's ranks spawned and driven as one (one rank included), each call
                      with the trainer endpoint's own signature
    handles.py        the handles the fleet holds, by actor class (SamplerHandle, ...): typed calls

The loop (grpo.py, build.py) builds these once and hands each what it needs, whole (the trainer's
ranks, the `Membership`, the `RolloutFlow`, a `SamplerSource` for the `Scaler`); nothing here
imports the loop (tests/test_layering.py).
"""
