"""One module per detector, grouped by concern (sampling/, recipe/).

A detector imports no other detector module and reads no files; what several
share lives in helper modules: analysis/position.py (where a rank is),
analysis/wording.py (rank lists, ordinals, error lines), analysis/waits.py
(a step's own work and waits), sampling/ledger.py and sampling/overlap.py,
recipe/common.py and recipe/setup.py. ``analysis.build.default_detectors``
puts the usual set together for a mode.
"""
