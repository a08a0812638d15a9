"""The ``ddpscope`` command line: one module per subcommand, wired up in main.py.

Nothing in this package imports torch at module level: the watcher side of
ddpscope (watch, report, replay, dump) must start on a machine without it.
"""
