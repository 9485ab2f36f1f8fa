"""Tests of deploy/: the systemd units, the example configs, the Prometheus files."""
