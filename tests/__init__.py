"""ddpscope's tests, a package so that tests and benchmarks import helpers alike.

- tests/unit: one process; nothing waits on another process, a job, a
  terminal or a message over a socket (tests/unit/test_layout.py checks).
- tests/e2e: real torchrun jobs, subprocesses, sockets, pseudo-terminals, tmux.
- tests/support: the helpers both share, imported as ``tests.support.<module>``
  (benchmarks too, run from the root as ``python -m benchmarks.<name>``).
- tests/jobs: framework job scripts the e2e tests launch.

``make test`` runs everything; ``make test-unit`` and ``make test-e2e`` one half.
They run a pytest-xdist worker per core, a file to a worker at a time: no test
may lean on another file's tests having run first (or not), and what a module
shares between its tests (a module-scoped job, a corpus) no test may change.
"""
