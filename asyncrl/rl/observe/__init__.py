"""What a run records and shows of itself while it runs: each step's typed record (record.py:
`StepRecord`) written to metrics.jsonl and fanned out to its viewers (metrics.py, writers.py: TensorBoard,
W&B; progress.py: the console; endpoint.py: Prometheus and /healthz; painter.py: curves.png), the
sync phases of a step (sync_metrics.py), episodes.jsonl (episodes_log.py), log.txt (runlog.py),
the stall watch (stall.py) and the end-of-run report (report.py).

The loop (``rl/driver``) builds the record and hands it over; nothing here imports the driver
(tests/test_layering.py). Reading a finished run directory back is ``rl/view``'s."""
