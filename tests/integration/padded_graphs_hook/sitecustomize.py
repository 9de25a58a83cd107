"""First on a process's PYTHONPATH (tests/integration/padded_graphs.py), Python imports this at
start: its engine's runners then pad their steps as CUDA graphs would, on the CPU."""

from tests.integration.padded_graphs import install

install()
