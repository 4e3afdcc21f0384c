"""bench/moe_knob_ab.py: the in-process A/B of environment-variable variants."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import moe_knob_ab  # noqa: E402


def test_variants_alternate_and_the_environment_is_restored(capsys, monkeypatch):
    monkeypatch.setenv("GLM5_AB_LEFTOVER", "1")   # a knob set before the run is not a variant's
    seen = []
    real = moe_knob_ab.set_variant
    monkeypatch.setattr(moe_knob_ab, "set_variant", lambda v: (seen.append(v), real(v)))
    moe_knob_ab.main(["--preset", "tiny", "--seconds", "0", "--T", "1,2", "--threads", "1",
                      "-", "GLM5_AB_X=1,GLM5_AB_Y=2"])
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("T=")]
    assert [l.split(",")[0].split()[0] for l in lines] == ["T=1", "T=2"]
    for line in lines:
        assert "[-]" in line and "[GLM5_AB_X=1,GLM5_AB_Y=2]" in line and "faster in" in line
    assert seen.count("GLM5_AB_X=1,GLM5_AB_Y=2") >= 3   # the check up front, then each T's round
    assert not [k for k in os.environ if k.startswith("GLM5_AB_")]


@pytest.mark.parametrize("bad", ["GLM5_AB_X", "OTHER=1", "GLM5_AB_X=1,,"])
def test_a_malformed_variant_is_refused_before_the_setup(bad):
    with pytest.raises(ValueError, match="variant"):
        moe_knob_ab.main(["--preset", "tiny", "--seconds", "0", "-", bad])
