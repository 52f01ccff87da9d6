"""Process replay: every preset's generated CUDA (decode and prefill) matches the checked-in
manifest (tools/replay.py). A change meant to alter generated code refreshes it with
`python -m fuselm.tools.replay --write` and says in its commit which kernels changed and why."""
from __future__ import annotations

import json

from fuselm.tools.replay import MANIFEST, differences, manifest


def test_generated_code_matches_the_replay_manifest():
    diff = differences(json.loads(MANIFEST.read_text()), manifest())
    assert not diff, ("generated code differs from tests/replay_manifest.json (refresh with "
                      "`python -m fuselm.tools.replay --write` if meant):\n" + "\n".join(diff))


def test_the_comparison_sees_a_changed_kernel():
    old = json.loads(MANIFEST.read_text())
    new = json.loads(json.dumps(old))
    step = new["presets"]["smollm2-135m"]["decode"]
    name = next(iter(step["kernels"]))
    step["kernels"][name] = "0" * 16
    new["headers"]["common.cuh"] = "changed"
    assert differences(old, new) == [f"header common.cuh: {old['headers']['common.cuh']} -> changed",
                                     f"smollm2-135m decode: kernel {name} source changed"]
