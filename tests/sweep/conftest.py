"""What the sweep tests share: sweep.py's arguments (the smoke data cache is tests/conftest.py's data_cache), and
one smoke doe20 run by the local launcher (test_sweep checks it end to end)."""

import csv

import pytest

from tests.conftest import run_script, sweep_args


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="session")
def smoke_doe20(tmp_path_factory, data_cache):
    out = tmp_path_factory.mktemp("doe20")
    proc = run_script(sweep_args(out, data_cache, "--grid", "doe20", "--workers", "2"), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc
