"""One module per detector, grouped by concern (sampling/, recipe/).

A detector imports no other detector module; what several share lives in
helper modules (analysis/position.py, analysis/wording.py, sampling/ledger.py,
recipe/common.py, recipe/setup.py). ``analysis.build.default_detectors`` puts
the usual set together for a mode.
"""
