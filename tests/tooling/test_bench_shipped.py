"""benchgpu/benchdet ``--as-shipped``: the server with no tuning flag against the bare model of
the same run, on real servers (on the CPU here, with the tiny frame-integrity model). Behaviour
and the report's structure, not speed."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def means_repo(tmp_path_factory) -> Path:
    from tests.tools.integrity import make_repo

    return make_repo(tmp_path_factory.mktemp("shipped") / "repo")


def test_as_shipped_reports_bare_ratios_non_200_answers_and_the_median_of_runs(
        means_repo, tmp_path):
    """Three runs of two servers (as shipped; another copy of the code whose body limit refuses
    the larger frames): each run has the bare model, one client with its breakdown and each
    saturation load as a ratio to the bare figure of that run; every refused answer is counted
    by status and reason; each figure's median is the median of the runs' values."""
    import visionserve
    from visionserve_tools import benchgpu, benchshipped

    other = tmp_path / "other"  # "another commit": this code, saying where it runs from
    shutil.copytree(Path(visionserve.__file__).parent, other / "visionserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "visionserve" / "__init__.py", "a") as f:
        f.write("\nprint('code from', __file__, flush=True)\n")
    small, large = benchgpu.make_jpegs(2, 48, 64), benchgpu.make_jpegs(2, 240, 320)
    assert max(map(len, small)) < 4096 < min(map(len, large))
    specs = [benchgpu.settings_spec(""),
             benchgpu.settings_spec(f"CODE={other},VISIONSERVE_MAX_BODY_BYTES=4096")]
    res: dict = {}
    benchshipped.as_shipped(means_repo, "means", {"64x48": small, "320x240": large}, specs,
                            runs=3, clients=(2,), procs=1, seconds=0.5, device="cpu", quick=True,
                            log_dir=tmp_path, res=res)
    shipped, limited = "0: as shipped", f"1: CODE={other},VISIONSERVE_MAX_BODY_BYTES=4096"
    assert res["setup"]["servers"] == [shipped, limited]
    assert len(res["runs"]) == 3
    for r, run in enumerate(res["runs"]):
        bare = run["bare"]
        assert bare["batch"]["batch_size"] == 16 and bare["batch"]["img_per_s"] > 0  # max 16
        assert bare["one"]["batch_size"] == 1 and bare["one"]["ms"] > 0
        for size in ("64x48", "320x240"):
            pipe = bare["single_frame_pipeline"][size]
            assert pipe["total_ms"] == pytest.approx(pipe["prepare_ms"] + pipe["model_ms"], 1e-3)
        ok, refused = run[shipped], run[limited]
        assert ok["settings"] == {} and refused["settings"] == specs[1]
        # no tuning flag: the server's command line has only the model, device and ports
        command = ok["startup_log"][0]
        assert "--models" in command and "--device cpu" in command
        assert "--frontends" not in command and "--log-level" not in command
        assert any("ready" in line for line in ok["startup_log"])
        one = ok["single_client"]
        assert one["answers"] > 0 and one["errors"] == 0
        assert one["ratio_to_bare_single_frame_pipeline"] == pytest.approx(
            one["p50_ms"] / bare["single_frame_pipeline"]["64x48"]["total_ms"], rel=1e-3)
        b = one["breakdown_ms"]
        for part in ("client_p50", "http_read_and_queue", "decode_resize_copy", "model",
                     "post_process", "verdict_to_answer", "answer_outside_server"):
            assert isinstance(b[part], float), part
        assert b["model"] > 0 and b["client_p50"] >= b["http_read_and_queue"]
        assert b["not_available"]
        for key in ("64x48@2", "320x240@2"):
            sat = ok["saturation"][key]
            assert sat["answers"] > 0 and sat["errors"] == 0 and sat["clients"] == 2
            assert sat["non_200"] == {"by_status": {}, "by_reason": {}}
            assert sat["ratio_to_bare_bs32"] == benchshipped.ratio(sat["throughput_per_s"],
                                                                    bare["batch"]["img_per_s"])
        # the other code served (its log says where from); the larger frames were all refused
        assert "code from" not in (tmp_path / f"shipped-{r}-0.log").read_text()
        assert f"code from {other}" in (tmp_path / f"shipped-{r}-1.log").read_text()
        small = refused["saturation"]["64x48@2"]
        assert small["errors"] == 0, small["non_200"]
        big = refused["saturation"]["320x240@2"]
        assert big["answers"] == 0 and big["errors"] > 0
        assert big["non_200"]["by_status"] == {"413": big["errors"]}
        (reason, n), = big["non_200"]["by_reason"].items()
        assert n == big["errors"]
        assert reason.startswith("413 ") and "max_body_bytes" in reason and "N" in reason
    # the median of the three runs' values, and the values themselves
    for name, key in ((shipped, "64x48@2 ratio_to_bare_bs32"),
                      (shipped, "single_client p50_ms"),
                      (shipped, "single_client ratio_to_bare_single_frame_pipeline"),
                      (limited, "320x240@2 non_200"), ("bare", "batch img_per_s"),
                      ("bare", "single_frame_pipeline 64x48 ms")):
        fig = res["median"][name][key]
        assert len(fig["runs"]) == 3
        assert fig["median"] == benchshipped.rounded(statistics.median(fig["runs"]))
    assert res["median"][shipped]["64x48@2 non_200"]["runs"] == [0, 0, 0]


def test_the_command_line_runs_as_shipped_on_the_cpu(means_repo, tmp_path, capsys):
    """``benchgpu --as-shipped --device cpu`` and ``benchdet`` the same, with a repository's model:
    the results file has the setup, the runs and the medians; a --compare SPEC runs after the
    server as shipped."""
    from visionserve_tools import benchdet, benchgpu

    args = ["--as-shipped", "--quick", "--device", "cpu", "--models", str(means_repo),
            "--model", "means", "--clients", "2", "--seconds", "0.5"]
    other = "VISIONSERVE_SWITCH_INTERVAL_MS=1"
    assert benchgpu.main([*args, "--compare", other, "--out", str(tmp_path / "gpu.json")]) == 0
    assert benchdet.main([*args, "--out", str(tmp_path / "det.json")]) == 0
    for name, servers in (("gpu.json", ["0: as shipped", f"1: {other}"]),
                          ("det.json", ["0: as shipped"])):
        out = json.loads((tmp_path / name).read_text())["as_shipped"]
        assert out["setup"]["sizes"] == ["640x480", "1080p"] and out["setup"]["clients"] == [2]
        assert out["setup"]["servers"] == servers  # as shipped first, then each --compare
        assert len(out["runs"]) == 1
        assert set(out["median"]) == {"bare", *servers}
        for server in servers:
            assert out["median"][server]["640x480@2 ratio_to_bare_bs32"]["median"] > 0
    assert "0: as shipped: 1080p@2 ratio_to_bare_bs32" in capsys.readouterr().err


def test_without_cuda_the_as_shipped_mode_says_so_in_one_line(tmp_path, capsys):
    import torch

    from visionserve_tools import benchdet, benchgpu

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for tool in (benchgpu, benchdet):
        assert tool.main(["--as-shipped", "--out", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs a CUDA device" in err
        assert "--device cpu" in err
    assert not (tmp_path / "x.json").exists()
