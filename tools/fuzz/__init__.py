"""Fuzzing every parser that takes outside bytes (doc/fuzzing.md): the C harnesses under vulpes/fuzz/ with
libFuzzer (`tools.fuzz.native`), and the Python properties with hypothesis, driven by atheris for the long
pass (`tools.fuzz.properties`). ``python -m tools.fuzz`` runs them; tests/test_fuzz.py runs a short pass."""
