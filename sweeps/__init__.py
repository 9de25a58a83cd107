"""Kernel sweeps, probes and peer runs: research scripts run from a checkout on a GPU machine
(`python -m sweeps.NAME --help`), not part of the installed package; see README.md here."""
