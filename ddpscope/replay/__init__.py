"""Post-mortem replay: a recorded run played back in the watch UI.

:mod:`ddpscope.replay.index` reads a recording once (in the background) and
keeps where each record is and when each finding was raised;
:mod:`ddpscope.replay.player` plays it into the same monitor and snapshots a
live watcher uses.
"""
