"""Zygotes: actors forked from a process that has imported a run's heavy modules once.

    zygote.py   the supervisor's side: a zygote's start, its Spawn requests over a Unix socket
                (msgpack, no code), each child a `ZygoteProcess`; where a fork would not give what
                a fresh process gives, `Popen` instead
    serve.py    the zygote process itself: preloads, serves Spawn requests, forks, and sets up in
                the child what Popen would give (session, fds, environment, threads, seeds)
    pool.py     `ZygotePool`: zygotes kept between the supervisors of one process (a test suite, a
                notebook), one supervisor at a time each

See docs/runtime.md ("The zygote").
"""
