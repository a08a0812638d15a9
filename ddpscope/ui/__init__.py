"""The live terminal UI of ``ddpscope watch`` (Textual).

Only this package imports textual. It reads plain snapshots built by
:mod:`ddpscope.analysis.live` and never touches telemetry itself; it never
imports torch. :func:`ddpscope.ui.app.build_app` builds the app for the
command line and for the tests alike.
"""
