"""End-to-end GRPO on a real model shape, on this host's GPUs: asyncrl sync and async, and TRL's
GRPOTrainer on the same model, step and machine when TRL is installed.

    python benchmarks/grpo_gpu.py --shape 0.5b                           # asyncrl sync + async, TRL if installed
    python benchmarks/grpo_gpu.py --shape 1.5b --runs async
    python benchmarks/grpo_gpu.py --shape 7b --lora-rank 16 --runs async,trl
    python benchmarks/grpo_gpu.py --shape 0.5b -- --trainer.micro_batch_tokens 4096   # our flags after --
    python benchmarks/grpo_gpu.py --shape 0.5b --runs async@1,async@2,sync@2   # on the first 1 and 2 GPUs
    python benchmarks/grpo_gpu.py --shape 0.5b --runs trl@2,async@2   # TRL's server mode on 2 GPUs beside ours
    python benchmarks/grpo_gpu.py --shape 1.5b --lengths lognormal:8192 --runs sync,async --steps 6 --skip 2  # long

The model is a random Qwen2 of the shape in bf16 with the embedded byte-level tokenizer
(`sampler_backends.make_model`): random weights never emit the stop token, so every completion has
``--max-new-tokens`` tokens and both systems do the same work. A step is ``--prompts`` Countdown
prompts x ``--group-size`` completions, temperature 0.7, learning rate 1e-6, no KL term; uniform
groups are not left out (TRL trains on them too). asyncrl runs as a user would run it:
``asyncrl launch examples/grpo_countdown.py --model_path CKPT --sampler.backend vllm`` plus the
step's shape, with the device plan's defaults (one GPU: the vLLM sampler colocated, CUDA IPC).
TRL: ``use_vllm=True, vllm_mode="colocate"``, fp32 weights with bf16 autocast, micro-batches of
``--prompts`` sequences, the same vLLM memory share (0.3).

Figures are steady state: the first ``--skip`` steps (start-up, compilation) are left out. In
async, the step after them can train from what the engine made during the slow first step, which
flatters async where a step is long (long generations): there take ``--skip 2`` and three or more
steps after it.
samples/s = completions trained / wall time; tokens/s = completion tokens / wall time. asyncrl's
phases per step (from metrics.jsonl): generate = the wait for the step's groups, train, sync, and
idle = the rest of the step's wall time (evaluation and checkpoints are outside the window).
``ideal_share`` in the JSON: max(the sampler's time to generate a batch, train + sync) / step time,
the share of a perfect overlap reached.

Long generations (``--lengths PROFILE``, asyncrl's ``--sampler.lengths``): each completion runs
exactly a length drawn from the profile (``uniform:N``, or ``lognormal:N``: median N/4, capped
at N; asyncrl/rl/config/lengths.py), since random weights never stop; the model gets room for N
new tokens. Its rows add the mean completion length trained, the mean version lag of the tokens
trained, groups whose tokens span versions, the run's stale drops and the engines' preemptions
(the samplers keep vLLM's statistics: ``--sampler.engine_stats``); the JSON has the lengths
trained and dropped by bucket. TRL runs ``uniform:N`` only (its completions are as long as
``max_completion_length``).
``RUN@N`` runs asyncrl on the host's first N GPUs (``CUDA_VISIBLE_DEVICES``), so the device plan
decides as it would on such a host: one GPU colocated, 1 + samplers GPUs each its own. Each GPU's
busy share over the same steady window is ``nvidia-smi``'s utilization (the share of time a kernel
ran), sampled every 200 ms. Below the table, the CPU each process of an asyncrl run used over the
same window, in cores, by its role (``process_cpu.py``: ``sampler0``, its vLLM engine core
``sampler0 engine``, ``trainer``, the driver ``launch ...``): where a sampler's CPU bound lies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from process_cpu import ProcessCpu  # noqa: E402
from sampler_backends import SHAPES, make_model, prompt_ids  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_SHARE = 0.3  # the share of GPU memory a colocated vLLM takes (asyncrl's COLOCATED_VLLM_SHARE)


class GpuBusy:
    """``nvidia-smi``'s utilization of every GPU, sampled every 200 ms and stamped on arrival."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, float]] = []  # (time, gpu index, busy 0..1)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                index, busy = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), int(index), busy / 100))

    def share(self, start: float, end: float) -> dict[str, float]:
        """Each GPU's mean busy share between two wall-clock times."""
        per: dict[int, list[float]] = {}
        for t, gpu, busy in list(self.samples):
            if start <= t <= end:
                per.setdefault(gpu, []).append(busy)
        return {str(g): round(statistics.mean(v), 3) for g, v in sorted(per.items())}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def watch_steps(path: str, stamps: dict[int, float], done: threading.Event) -> None:
    """Stamp the wall-clock time at which metrics.jsonl reaches each line count."""
    while not done.wait(0.1):
        try:
            with open(path) as f:
                n = sum(1 for _ in f)
        except OSError:
            continue
        stamps.setdefault(n, time.time())


def run_logged(cmd: list[str], env: dict, log_path: str) -> tuple[int, str]:
    """Run ``cmd`` to its end with its output in ``log_path`` (not a pipe: a run stopped by the
    device's time limit or a ^C leaves its log to read); its exit code and output."""
    print(f"  (its output: {log_path})", flush=True)
    with open(log_path, "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    with open(log_path) as log:
        return code, log.read()


def asyncrl_run(mode: str, args, model: str, run_dir: str, gpus: int = 0) -> dict:
    steps = args.steps
    # The run directory is this benchmark's own (named by shape and mode under --out): an earlier
    # invocation with the same --out left its run there, which the launch would refuse to reuse.
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "launch",
        os.path.join(ROOT, "examples", "grpo_countdown.py"),
        "--model_path",
        model,
        "--sampler.backend",
        "vllm",
        "--run.mode",
        mode,
        "--run.steps",
        str(steps),
        "--run.groups_per_step",
        str(args.prompts),
        "--sampler.group_size",
        str(args.group_size),
        "--sampler.max_new_tokens",
        str(args.max_new_tokens),
        "--trainer.lr",
        "1e-6",
        "--run.skip_uniform_groups",
        "false",
        "--run.eval_every",
        str(steps),
        "--run.n_heldout",
        "16",
        "--run.eval_samples",
        "0",
        "--run.checkpoint_every",
        "0",
        "--run.run_dir",
        run_dir,
    ]
    if args.lora_rank:
        cmd += ["--trainer.lora.rank", str(args.lora_rank), "--trainer.lora.bf16_base", "true"]
    if args.lengths:
        cmd += ["--sampler.lengths", args.lengths, "--sampler.engine_stats", "true"]
    cmd += args.extra
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    print("$", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if gpus else "", " ".join(cmd[2:]), flush=True)
    busy, cpu, stamps, finished = GpuBusy(), ProcessCpu(), {}, threading.Event()
    watcher = threading.Thread(
        target=watch_steps, args=(os.path.join(run_dir, "metrics.jsonl"), stamps, finished), daemon=True
    )
    watcher.start()
    start = time.monotonic()
    try:
        code, output = run_logged(cmd, env, run_dir + ".log")
    finally:
        finished.set()
        watcher.join()
        busy.close()
        cpu.close()
    wall = time.monotonic() - start
    if code != 0:
        tail = "\n".join(output.splitlines()[-15:])
        return {"error": f"exit {code}: {tail}", "wall_s": wall}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    window = records[args.skip : -1]  # the last step holds the final evaluation
    first, last = records[args.skip - 1], records[-2]
    span = last["time_s"] - first["time_s"]
    step_s = span / len(window)
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in window)  # noqa: E731
    gen, train, sync = mean("wait_s"), mean("train_s"), mean("sync_s")
    trained_by_length: dict[str, int] = {}
    for r in window:
        for bucket, n in r.get("length_hist", {}).items():
            trained_by_length[bucket] = trained_by_length.get(bucket, 0) + n
    # Each step's record counts its own (a run cut short still tells), from the measured window.
    counted = [r["engine_preemptions"] for r in window if "engine_preemptions" in r]
    steady = (stamps.get(args.skip, 0.0), stamps.get(len(records) - 1, time.time()))
    return {
        "length_mean": mean("length_mean"),
        "token_lag_mean": mean("token_lag_mean"),
        "token_lag_max": max(r.get("token_lag_max", 0) for r in window),
        "spanning_groups": sum(r.get("spanning_groups", 0) for r in window),
        "dropped_stale": records[-1].get("dropped_stale", 0),
        "dropped_by_length": records[-1].get("dropped_lengths") or {},
        "trained_by_length": trained_by_length,
        "preemptions": sum(counted) if counted else None,
        "kv_cache_peak": max((r["engine_kv_cache_peak"] for r in window if "engine_kv_cache_peak" in r), default=None),
        "samples_per_s": sum(r["sequences"] for r in window) / span,
        "tokens_per_s": sum(r["completion_tokens"] for r in window) / span,
        "step_s": step_s,
        "generate_s": gen,
        "train_s": train,
        "sync_s": sync,
        "idle_s": max(step_s - gen - train - sync, 0.0),
        "micro_batches": mean("micro_batches"),
        "mfu": mean("mfu") if "mfu" in window[0] else None,
        "wall_s": wall,
        "steps": len(window),
        "peak_gib": max(r.get("peak_mem_gib", 0.0) for r in records) or None,
        "sync_phases": {
            k: mean(k)
            for k in sorted(window[0])
            if k.startswith("sync_") and k != "sync_s" and isinstance(window[0][k], (int, float))
        },
        "micro_batch_tokens": window[0].get("micro_batch_tokens"),
        "first_step_s": records[0]["time_s"],
        "gpu_busy": busy.share(*steady),
        "cpu_cores": cpu.cores(*steady),
        "sampler_generate_s": mean("generate_s"),
        # the best a step can do: the sampler's generation of a batch, or the trainer's step and sync
        "ideal_share": max(mean("generate_s"), train + sync) / step_s,
    }


def trl_run(args, model: str, out_dir: str, gpus: int = 0) -> dict:
    """TRL in a child process of its own (its vLLM engine and CUDA context go with it). ``gpus`` 2:
    TRL's server mode, as its docs run it on two GPUs: ``trl vllm-serve`` on GPU 1 (90% of its
    memory), the GRPOTrainer on GPU 0 pushing weights to it over NCCL after every step."""
    if gpus not in (0, 1, 2):
        raise SystemExit("trl@N: N is 1 (colocated) or 2 (server mode)")
    server = None
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    extra: list[str] = []
    if gpus == 2:
        port = 8000 + os.getpid() % 1000
        server = subprocess.Popen(
            [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", model, "--port", str(port)]
            + ["--host", "127.0.0.1", "--gpu_memory_utilization", "0.9"],
            env={**env, "CUDA_VISIBLE_DEVICES": "1"},
            stdout=open(os.path.join(out_dir, "trl-vllm-serve.log"), "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        env["CUDA_VISIBLE_DEVICES"] = "0"
        extra = ["--trl-server", f"http://127.0.0.1:{port}"]
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--trl-child",
        model,
        "--shape",
        args.shape,
        "--steps",
        str(args.steps),
        "--skip",
        str(args.skip),
        "--prompts",
        str(args.prompts),
        "--group-size",
        str(args.group_size),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--lora-rank",
        str(args.lora_rank),
        "--out",
        out_dir,
        *extra,
    ]
    start = time.monotonic()
    try:
        code, output = run_logged(cmd, env, os.path.join(out_dir, "trl.log"))
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    wall = time.monotonic() - start
    result = [line for line in output.splitlines() if line.startswith("TRL_RESULT ")]
    if code != 0 or not result:
        tail = "\n".join(output.splitlines()[-25:])
        return {"error": f"exit {code}: {tail}", "wall_s": wall}
    return {**json.loads(result[-1][len("TRL_RESULT ") :]), "wall_s": wall}


def trl_child(args) -> None:
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # datasets' fingerprinting (dill) cannot hash a pyarrow type in this image; a counter will do.
    counter = iter(range(1 << 30))
    datasets.fingerprint.Hasher.hash = classmethod(lambda cls, value: f"h{next(counter)}")
    tok = AutoTokenizer.from_pretrained(args.trl_child)
    prompts = [tok.decode(ids) for ids in prompt_ids(args.trl_child, args.prompts * (args.steps + 2))]
    data = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            torch.cuda.synchronize()
            times.append(time.perf_counter())

    def reward(completions, **_kw):  # any cheap, non-uniform reward: the work is the same
        return [float(len(c) % 2) for c in completions]

    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_rank,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"),
        per_device_train_batch_size=args.prompts,
        gradient_accumulation_steps=args.group_size,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=0.7,
        learning_rate=1e-6,
        beta=0.0,
        use_vllm=True,
        vllm_mode="server" if args.trl_server else "colocate",
        vllm_server_base_url=args.trl_server or None,
        vllm_server_timeout=600.0,  # the server's vLLM engine starts while the trainer loads
        vllm_gpu_memory_utilization=VLLM_SHARE,
        bf16=True,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        model_init_kwargs={"dtype": torch.bfloat16 if args.lora_rank else torch.float32},
    )
    trainer = GRPOTrainer(
        model=args.trl_child,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
        peft_config=peft_config,
    )
    start = time.perf_counter()
    trainer.train()
    per_step = args.prompts * args.group_size
    span = times[-1] - times[args.skip - 1]
    steps = len(times) - args.skip
    print(
        "TRL_RESULT "
        + json.dumps(
            {
                "samples_per_s": per_step * steps / span,
                "tokens_per_s": per_step * steps * args.max_new_tokens / span,
                "step_s": span / steps,
                "first_step_s": times[0] - start,
                "steps": steps,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        ),
        flush=True,
    )


def make_shape(shape: str, path: str, positions: int = 1024) -> None:
    if not os.path.exists(os.path.join(path, "config.json")):
        t = time.monotonic()
        make_model(path, SHAPES[shape], "bfloat16", positions)
        print(f"made a random {shape} Qwen2 in {path} ({time.monotonic() - t:.0f} s)", flush=True)


def _percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{100 * fraction:.0f}%"


def table(shape: str, results: dict[str, dict], long: bool = False) -> str:
    rows = [
        "| run | samples/s | tokens/s | step s | generate s | train s | sync s | idle s | trainer MFU | "
        "trainer peak GiB | GPUs busy | wall s |"
        + (" mean length | token lag | spanning groups | dropped | preemptions | KV cache peak |" if long else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|---|---|" if long else ""),
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(
                f"| {name} | failed: {r['error'].splitlines()[-1][:90]} | | | | | | | | | | {r['wall_s']:.0f} |"
            )
            continue
        cell = lambda k, r=r: f"{r[k]:.2f}" if r.get(k) is not None else ""  # noqa: E731
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else ""
        busy = " / ".join(f"{100 * b:.0f}%" for b in r.get("gpu_busy", {}).values())
        rows.append(
            f"| {name} | {r['samples_per_s']:.1f} | {r['tokens_per_s']:.0f} | {cell('step_s')} | "
            f"{cell('generate_s')} | {cell('train_s')} | {cell('sync_s')} | {cell('idle_s')} | {mfu} | "
            f"{cell('peak_gib')} | {busy} | {r['wall_s']:.0f} |"
            + (
                f" {r.get('length_mean', 0):.0f} | {r.get('token_lag_mean', 0):.2f} | {r.get('spanning_groups', '')} | "
                f"{r.get('dropped_stale', '')} | {r.get('preemptions') if r.get('preemptions') is not None else ''} | "
                f"{_percent(r.get('kv_cache_peak'))} |"
                if long
                else ""
            )
        )
    for name, r in results.items():
        if r.get("cpu_cores"):
            rows.append(f"CPU cores, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items()))
    for peer, p in results.items():
        if peer.startswith("trl") and p.get("samples_per_s"):
            rows += [
                f"{name}: {r['samples_per_s'] / p['samples_per_s']:.2f}x {peer}"
                for name, r in results.items()
                if not name.startswith("trl") and "samples_per_s" in r
            ]
    return f"{shape}\n" + "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(s for s in SHAPES if s != "embedded"), default="0.5b")
    parser.add_argument(
        "--runs",
        default="sync,async,trl",
        help="any of sync, async, trl (trl: if installed); sync@N / async@N: on the first N GPUs; "
        "trl@2: TRL's server mode (trl vllm-serve on GPU 1, the trainer on GPU 0)",
    )
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="start-up steps left out of the figures")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA on a bf16 base (both systems)")
    parser.add_argument(
        "--lengths",
        default="",
        help="each completion's length from this profile: uniform:N or lognormal:N (sets N new tokens)",
    )
    parser.add_argument("--out", default="", help="model and run directories (default: a temporary one)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--trl-child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--trl-server", default="", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="asyncrl flags, after --")
    args = parser.parse_args()
    if args.trl_child:
        return trl_child(args)
    if args.skip < 1 or args.steps < args.skip + 3:
        parser.error("need --skip >= 1 and --steps >= --skip + 3")
    positions = 1024
    if args.lengths:
        kind, _, cap = args.lengths.partition(":")
        if kind not in ("uniform", "lognormal") or not cap.isdigit():
            parser.error("--lengths is uniform:N or lognormal:N")
        args.max_new_tokens = int(cap)
        positions = max(1024, 1 << (int(cap) + 512 - 1).bit_length())  # room for the prompt too
    out = args.out or tempfile.mkdtemp(prefix="grpo-gpu-")
    model = os.path.join(out, f"model-{args.shape}" + (f"-{positions}" if positions != 1024 else ""))
    make_shape(args.shape, model, positions)
    results: dict[str, dict] = {}
    for name in args.runs.split(","):
        if name.partition("@")[0] == "trl":
            if args.lengths and not args.lengths.startswith("uniform:"):
                print("TRL's completions run to max_completion_length: its row needs --lengths uniform:N", flush=True)
                continue
            try:
                import trl  # noqa: F401
            except ImportError:
                print("TRL is not installed: its row is left out", flush=True)
                continue
            gpus = int(name.partition("@")[2] or 0)
            results["trl" if gpus < 2 else "trl, 2 GPUs (server mode)"] = trl_run(args, model, out, gpus)
        else:
            mode, _, gpus = name.partition("@")
            label = f"asyncrl {mode}" + (f", {gpus} GPU{'s' if gpus != '1' else ''}" if gpus else "")
            results[label] = asyncrl_run(
                mode, args, model, os.path.join(out, f"run-{args.shape}-{mode}{gpus}"), int(gpus or 0)
            )
        print(json.dumps({name: results[list(results)[-1]]}), flush=True)
    print(
        table(
            f"{args.shape}{f' LoRA r{args.lora_rank}' if args.lora_rank else ''}, {args.prompts} x "
            f"{args.group_size} x {args.lengths or args.max_new_tokens} a step",
            results,
            long=bool(args.lengths),
        )
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "lora_rank": args.lora_rank, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
