"""GPU tests (`make test-gpu`). A package, so that its conftest.py is imported as `gpu.conftest` and never takes
the place of tests/conftest.py, which the other test modules import as `conftest`."""
