"""python -m cxlkv.bench runs end to end and reports every figure next to its C++ reference."""
import json
import os
import subprocess
import sys

import pytest


def test_the_bench_reports_each_figure_next_to_the_cpp_one():
    if not os.environ.get("CXLKV_CLI"):
        pytest.skip("ctest sets CXLKV_CLI (the C++ figures come from `cxlkv bench cache`)")
    out = subprocess.run([sys.executable, "-m", "cxlkv.bench", "--quick", "--json"], check=True,
                         capture_output=True, text=True, timeout=600).stdout
    report = json.loads(out)
    names = {r["name"]: r for r in report["results"]}
    assert set(names) == {"py_put/2MiB", "py_get/2MiB", "py_exists_prefix/chain256", "py_put_many/llama8b",
                          "py_get_many_into/llama8b"}
    for r in names.values():
        assert r["median"] > 0 and len(r["samples"]) == 2
        assert r["reference_median"] and r["reference_median"] > 0
        assert r["ratio"] > 0 and r["higher_is_better"] is True
