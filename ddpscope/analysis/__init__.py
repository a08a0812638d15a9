"""The diagnosis layer: a run model fed by live or recorded telemetry, and detectors.

Pure Python: nothing here imports torch or textual, so the watcher and the
report run on a laptop. The same code serves a live stream and record files.
"""
