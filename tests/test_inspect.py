"""`fuselm inspect` (no GPU): kernel files, schedule table, JSON, per-layer kernel counts, --no-fuse,
--dump, --compile, on a preset and on a tiny HF folder; bad input is one error line. Also the
`fuselm bench` wiring (its one-line error without a GPU)."""
from __future__ import annotations

import json
import re

import pytest

from fuselm import cli
from fuselm.codegen import Target, Tuning, headers
from fuselm.codegen.attention import Layout, Pass
from fuselm.compiler.pipeline import passes
from fuselm.tools import inspect as insp

PRESET = "llama-3.2-1b"
# positions below which Llama-3.2-1B's attention (8 KV heads of 64, 4 query heads each) runs in one launch
SINGLE_UNTIL = Layout(kv=8, head_dim=64, group=4, target=Target(), tuning=Tuning()).single_until
FIELDS = {"kernel", "family", "layer", "nodes", "grid", "block", "bytes_read", "bytes_written"}


def run_main(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, fragment):
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


def expected(model: str, fuse: bool = True):
    """(compiled graph, kernels) built directly, to check what inspect prints against."""
    cfg, _, _ = insp.load_config(model)
    G, kernels, _ = insp.build(cfg, fuse=fuse)
    return G, kernels


def launches_of(kernels):
    return [(k, launch) for k in kernels for launch in k.launches]


def table_rows(text: str) -> list[list[str]]:
    """The rows of the schedule table: lines that start with a launch number."""
    return [line.split() for line in text.splitlines() if re.match(r"\s*\d+\s+\w+\s+(-|\d+)\s+\d+x\d+\s", line)]


@pytest.fixture(scope="module")
def preset_json():
    """inspect PRESET --json, through the CLI in this process."""
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["inspect", PRESET, "--json"]) == 0
    return json.loads(buf.getvalue())


# ---- a preset -------------------------------------------------------------------------------------

def test_table_lists_every_launch_and_the_summary(capsys):
    G, kernels = expected(PRESET)
    rc, out, err = run_main(capsys, "inspect", PRESET)
    assert rc == 0, err
    rows = table_rows(out)
    flat = launches_of(kernels)
    assert len(rows) == len(flat) > 0
    for i, (row, (k, launch)) in enumerate(zip(rows, flat)):
        assert row[0] == str(i) and row[1] == launch.function
        assert row[2] == ("-" if k.layer is None else str(k.layer))
        assert row[4] == str(launch.block)
        assert ", ".join(k.nodes) in " ".join(row)
    assert "kernels per layer: 5 (+1 attention combine), x 16 layers" in out
    assert (f"at positions below {SINGLE_UNTIL}: attention in one launch per layer, a block per KV head "
            "(<kernel>_single) (16 kernels)") in out
    assert ("attention passes: split MmaPass<8, 64, 8, 4> on tensor cores, one launch MmaPass<8, 64, 8, 4> "
            "on tensor cores (16 kernels)") in out
    assert (insp._pass_label(Pass("MmaPass<8, 64, 9, 4, true>", 288, on_tensor_cores=True, late_v=True))
            == "MmaPass<8, 64, 9, 4> on tensor cores, V rows after the queries")
    assert insp._pass_label(Pass("LanePass<8, 256, 8, 8, 2>", 256)) == "LanePass<8, 256, 8, 8, 2> on CUDA cores"
    assert f"launches per token: {len(flat)} " in out
    assert f"{G.graph['arena_bytes']:,} bytes with buffer reuse, {G.graph['arena_bytes_no_reuse']:,} without" in out
    assert G.graph["arena_bytes"] < G.graph["arena_bytes_no_reuse"]


def test_out_writes_every_distinct_kernel_and_the_schedule(capsys, tmp_path):
    _, kernels = expected(PRESET)
    rc, out, err = run_main(capsys, "inspect", PRESET, "--out", str(tmp_path))
    assert rc == 0, err
    names = {k.name for k in kernels}
    assert {p.name for p in tmp_path.iterdir()} == ({f"{n}.cu" for n in names} | set(headers())
                                                     | {"schedule.txt", "compile.sh"})
    assert f"wrote {len(names)} kernels" in out and "kernels per layer" in out
    for k in kernels:   # every use of a shared kernel (each layer) lists its own graph nodes
        text = (tmp_path / f"{k.name}.cu").read_text()
        assert ", ".join(k.nodes) in text
        assert k.source in text
        head = text[:text.index(k.source)]
        assert all(line.startswith("//") for line in head.splitlines())
    shared = [n for n in names if sum(k.name == n for k in kernels) == 16]
    # the kernels of a layer, one file each for all 16 layers; the Q/K/V GEMV one for layers 1-15
    # (they read the position before their wait, layer 0's after it: compiler/plan_early_reads.py)
    # (the others once: the embedding, layer 0's Q/K/V, the LM head, the sampler)
    assert len(shared) == 4 and sorted(sum(k.name == n for k in kernels) for n in names if n not in shared) == [1, 1, 1, 1, 15]
    rows = table_rows((tmp_path / "schedule.txt").read_text())
    assert [r[1] for r in rows] == [launch.function for _, launch in launches_of(kernels)]


def test_out_folder_compiles_with_nothing_but_itself(capsys, tmp_path):
    """Every kernel file --out writes compiles with NVRTC given that folder as its only include path
    (no headers handed over in memory), with the options compile.sh gives nvcc."""
    from fuselm.codegen.nvrtc import compile_cubin, options

    rc, _, err = run_main(capsys, "inspect", "smollm2-135m", "--out", str(tmp_path))
    assert rc == 0, err
    script = (tmp_path / "compile.sh").read_text()
    kernels = sorted(tmp_path.glob("*.cu"))
    assert kernels and all(k.name in script for k in kernels) and "-I." in script
    for k in kernels:
        cubin, _, _ = compile_cubin(k.read_text(), {}, options("sm_90") + [f"--include-path={tmp_path}"],
                                    use_cache=False)
        assert cubin[:4] == b"\x7fELF", k.name


@pytest.mark.parametrize("option", ["--out", "--dump"])
def test_out_or_dump_at_a_file_or_an_unwritable_place_is_one_error_line(capsys, tmp_path, option):
    afile = tmp_path / "a-file"
    afile.write_text("keep me")
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", option, str(afile)),
                          f"{option} {afile}: exists and is not a folder")
    assert afile.read_text() == "keep me"
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", option, str(afile / "below")),
                          f"{option} {afile / 'below'}: cannot write there")


def test_tuning_is_listed_and_a_bad_value_is_one_error_line(capsys):
    rc, out, _ = run_main(capsys, "inspect", "smollm2-135m", "--tuning", "--tune", "attn_wide_warps=0")
    assert rc == 0 and "attn_wide_warps = 0  # warps per block of the wide split (0: none)  (changed)" in out
    assert "gemv_warps = 8  # warps per GEMV block\n" in out
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", "--tune", "gemv_warps=6"),
                          "--tune: tuning gemv_warps=6: warps per GEMV block must be a power of 2")
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", "--tune", "warps=6"),
                          "--tune: tuning 'warps=6': expected name=value with a name among")


def test_sms_size_the_gemvs_split_k(capsys):
    """The SM count sizes split-K: a GPU of 16 SMs fills with fewer streaming warps, so the 1B's
    short GEMVs (O, down) share rows between fewer warps, and their tiles of more rows need fewer
    blocks; the long ones (Q/K/V, gate/up, the LM head) do not split on either."""
    few = json.loads(run_main(capsys, "inspect", PRESET, "--json", "--sms", "16")[1])
    many = json.loads(run_main(capsys, "inspect", PRESET, "--json")[1])
    assert (few["sms"], many["sms"]) == (16, 132)
    blocks = lambda doc: [l["grid"][0] for l in doc["launches"] if l["family"] == "gemv"]  # noqa: E731
    assert all(f <= m for f, m in zip(blocks(few), blocks(many))) and sum(blocks(few)) < sum(blocks(many))


def test_json_has_one_entry_per_launch(preset_json):
    G, kernels = expected(PRESET)
    entries = preset_json["launches"]
    flat = launches_of(kernels)
    assert len(entries) == len(flat)
    for i, (e, (k, launch)) in enumerate(zip(entries, flat)):
        assert FIELDS <= set(e)
        assert e["index"] == i and e["kernel"] == k.name and e["function"] == launch.function
        assert e["family"] == k.family and e["layer"] == k.layer and e["nodes"] == k.nodes
        assert e["block"] == launch.block and len(e["grid"]) == 2
        assert all(isinstance(g, int) and g >= 1 for g in e["grid"])
        assert isinstance(e["bytes_read"], int) and isinstance(e["bytes_written"], int)
    # a kernel's bytes are counted once, over its launches (plus the attention workspace)
    for k in kernels:
        mine = [e for e in entries if e["kernel"] == k.name and e["nodes"] == k.nodes]
        ws = 4 * k.workspace_floats * (len(k.launches) - 1)
        assert sum(e["bytes_read"] for e in mine) == k.bytes_read + ws
        assert sum(e["bytes_written"] for e in mine) == k.bytes_written + ws
    assert preset_json["arena_bytes"] == G.graph["arena_bytes"]
    assert preset_json["arena_bytes_no_reuse"] == G.graph["arena_bytes_no_reuse"]
    assert preset_json["fused"] is True and preset_json["ctx"] == 4096


def test_a_llama_layer_is_at_most_five_launches_plus_the_attention_combine(preset_json):
    by_layer: dict[int, list[dict]] = {}
    for e in preset_json["launches"]:
        if e["layer"] is not None:
            by_layer.setdefault(e["layer"], []).append(e)
    assert sorted(by_layer) == list(range(16))
    for layer, es in by_layer.items():
        combine = [e for e in es if e["function"].endswith("_combine")]
        assert len(combine) == 1 and combine[0]["family"] == "attention"
        assert len(es) - len(combine) <= 5, (layer, [e["function"] for e in es])
    nodes = [n for e in preset_json["launches"] if not e["function"].endswith("_combine") for n in e["nodes"]]
    assert len(nodes) == len(set(nodes))   # every graph node in exactly one kernel


def test_the_embedding_launch_reads_one_row_per_token(preset_json):
    from fuselm.models.presets import preset
    hidden = preset(PRESET).hidden_size
    (e,) = [e for e in preset_json["launches"] if any(n.startswith("embedding") for n in e["nodes"])]
    assert e["bytes_read"] <= hidden * 2 + 64    # one bf16 row + the token id


def test_no_fuse_gives_more_launches_over_the_same_nodes(capsys, preset_json):
    rc, out, err = run_main(capsys, "inspect", PRESET, "--no-fuse", "--json")
    assert rc == 0, err
    unfused = json.loads(out)
    assert unfused["fused"] is False
    assert len(unfused["launches"]) > len(preset_json["launches"])
    covered = lambda doc: {n for e in doc["launches"] for n in e["nodes"]}  # noqa: E731
    assert covered(unfused) == covered(preset_json)


def test_dump_writes_the_graph_after_every_pass(capsys, tmp_path):
    rc, _, err = run_main(capsys, "inspect", PRESET, "--dump", str(tmp_path / "d"), "--json")
    assert rc == 0, err
    names = ["lower"] + [getattr(p, "func", p).__name__ for p in passes(fuse=True)]
    want = {f"{i:02d}_{n}.{ext}" for i, n in enumerate(names) for ext in ("txt", "dot")}
    assert {p.name for p in (tmp_path / "d").iterdir()} == want
    assert all((tmp_path / "d" / f).stat().st_size > 0 for f in want)


def test_ctx_changes_the_attention_kernels(capsys, preset_json):
    rc, out, _ = run_main(capsys, "inspect", PRESET, "--ctx", "1000", "--json")
    assert rc == 0
    short = json.loads(out)
    assert short["ctx"] == 1000 and preset_json["ctx"] == 4096
    splits = [[e for e in d["launches"] if e["function"].endswith("_split")] for d in (short, preset_json)]
    assert len(splits[0]) == len(splits[1]) == 16
    for a, b in zip(*splits):   # fewer chunks of the cache, and the cache counted at 1000 rows
        assert a["grid"][1] < b["grid"][1] and a["bytes_read"] < b["bytes_read"]


def test_short_contexts_run_attention_in_one_launch():
    """Every attention kernel has a one-launch variant for positions below single_until; a step
    there has one launch per layer fewer, and the same launches otherwise."""
    G, kernels = expected(PRESET)
    att = [k for k in kernels if k.family == "attention"]
    assert att and SINGLE_UNTIL > 0
    for k in att:
        assert [(v.name, v.until) for v in k.variants] == [("single", SINGLE_UNTIL)]
        for position, suffixes in ((0, ["single"]), (SINGLE_UNTIL - 1, ["single"]),
                                   (SINGLE_UNTIL, ["split", "combine"])):
            assert [l.function for l in k.launches_at(position)] == [f"{k.name}_{s}" for s in suffixes], position
        assert k.launches_of("single")[0].grid == (G.nodes[k.nodes[0]]["attrs"]["n_kv_heads"], 1)   # a block per KV head
        assert k.launches_of("general") == k.launches
    others = [k for k in kernels if k.family != "attention"]
    assert all(k.launches_at(0) == k.launches_at(10**6) == k.launches and not k.variants for k in others)
    short = sum(len(k.launches_at(0)) for k in kernels)
    assert short == sum(len(k.launches) for k in kernels) - len(att)


def test_position_shows_the_schedule_of_that_step(capsys, preset_json):
    """--position P: below the switch point each layer's attention is one launch (`_single`)."""
    rc, out, _ = run_main(capsys, "inspect", PRESET, "--position", "0", "--json")
    assert rc == 0
    short = json.loads(out)
    assert short["position"] == 0 and preset_json["position"] is None
    singles = [e for e in short["launches"] if e["family"] == "attention"]
    assert len(singles) == 16 and all(e["function"].endswith("_single") for e in singles)
    assert len(short["launches"]) == len(preset_json["launches"]) - 16
    rc, out, _ = run_main(capsys, "inspect", PRESET, "--position", str(SINGLE_UNTIL), "--json")
    assert json.loads(out)["launches"] == preset_json["launches"]
    rc, out, _ = run_main(capsys, "inspect", PRESET, "--position", "0")
    assert rc == 0 and "at position 0" in out and "kernels per layer: 5, x 16 layers" in out


# ---- a tiny HF folder -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, h):
    """A tiny random LlamaForCausalLM saved by transformers, with a word-level tokenizer."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    model, _, _ = h.make_hf_model(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_hf_folder(capsys, monkeypatch, tmp_path, tiny_folder):
    import fuselm.loading.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "load_weights", lambda *a, **k: pytest.fail("inspect read the weights"))
    rc, out, err = run_main(capsys, "inspect", str(tiny_folder), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["architecture"] == "LlamaForCausalLM" and doc["ctx"] == 128
    layers = [e["layer"] for e in doc["launches"]]
    assert {l for l in layers if l is not None} == {0, 1}
    assert doc["launches"][-1]["family"] == "sample" and doc["launches"][-1]["nodes"] == ["logits"]
    rc, out, err = run_main(capsys, "inspect", str(tiny_folder), "--out", str(tmp_path / "k"))
    assert rc == 0, err
    assert "2 layers, hidden 32, 4 heads / 2 KV heads of 8, vocab 64" in out
    assert len(table_rows((tmp_path / "k" / "schedule.txt").read_text())) == len(doc["launches"])
    # the same model from its config.json alone
    rc, out2, _ = run_main(capsys, "inspect", str(tiny_folder / "config.json"), "--json")
    assert rc == 0 and json.loads(out2)["launches"] == doc["launches"]


def test_compile_reports_time_and_spills_per_function(capsys, tiny_folder):
    rc, out, err = run_main(capsys, "inspect", str(tiny_folder), "--compile", "--arch", "sm_80")
    assert rc == 0, err
    _, kernels = expected(str(tiny_folder))
    functions = {launch.function for k in kernels for launch in k.all_launches()}
    m = re.search(r"NVRTC sm_80: (\d+) functions compiled in ([\d.]+) s", out)
    assert m and int(m.group(1)) == len(functions)
    for f in functions:
        assert re.search(rf"^\s+{f}\s+\d+ regs\s+\d+ B stack\s+\d+ B spilled\s+\d+ blocks/SM\s+[\d.]+ waves$",
                         out, re.M), f
    rc, out, _ = run_main(capsys, "inspect", str(tiny_folder), "--compile", "--json")
    rep = json.loads(out)["compile"]
    assert rep["arch"] == "sm_90" and set(rep["functions"]) == functions
    assert all(v["spill_bytes"] >= 0 and v["registers"] > 0 for v in rep["functions"].values())
    launch = next(l for k in kernels for l in k.all_launches() if isinstance(l.grid[0], int) and l.grid[0] > 1)
    v = rep["functions"][launch.function]
    assert v["blocks_per_sm"] == Target().blocks_per_sm(launch.block, v["registers"], v["static_smem"] + launch.smem)
    assert v["waves"] == round(launch.grid[0] * launch.grid[1] / (v["blocks_per_sm"] * Target().sms), 2)


@pytest.mark.parametrize("threads,registers,smem,blocks", [
    (256, 128, 0, 2), (256, 64, 0, 4), (256, 255, 0, 1), (256, 72, 0, 3),   # registers: 256 a warp at a time
    (1024, 26, 0, 2), (32, 16, 0, 32),                                      # threads; at most 32 blocks
    (128, 32, 100 * 1024, 2), (128, 32, 120 * 1024, 1), (128, 32, 227 * 1024, 1)])   # shared memory, 1 KiB more a block
def test_blocks_an_sm_holds_follow_cudas_occupancy_rules(threads, registers, smem, blocks):
    assert Target().blocks_per_sm(threads, registers, smem) == blocks


# ---- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,fragment", [
    (["inspect", "no-such-model"], "'no-such-model' is neither a file or folder nor a preset"),
    (["inspect", PRESET, "--ctx", "0"], "--ctx must be a positive"),
    (["inspect", PRESET, "--arch", "90"], "--arch must look like sm_90"),
    (["inspect", PRESET, "--position", "-1"], "--position must be 0 or more"),
    (["inspect"], "required"),
])
def test_bad_input_is_one_error_line(capsys, argv, fragment):
    rc, out, err = run_main(capsys, *argv)
    assert_one_line_error(rc, out, err, fragment)


def test_bad_files_are_one_error_line(capsys, tmp_path):
    rc, out, err = run_main(capsys, "inspect", str(tmp_path))
    assert_one_line_error(rc, out, err, "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    rc, out, err = run_main(capsys, "inspect", str(bad))
    assert_one_line_error(rc, out, err, "invalid JSON")
    bad.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    rc, out, err = run_main(capsys, "inspect", str(bad))
    assert_one_line_error(rc, out, err, "missing required key")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    rc, out, err = run_main(capsys, "inspect", str(other))
    assert_one_line_error(rc, out, err, "not a checkpoint")


# ---- fuselm bench wiring --------------------------------------------------------------------------

def test_bench_without_a_gpu_is_one_error_line(capsys, monkeypatch):
    import fuselm.runtime.cuda_engine as cuda_engine

    monkeypatch.setattr(cuda_engine, "gpu_available", lambda: False)
    rc, out, err = run_main(capsys, "bench", "llama-3.2-1b", "--no-fuse")
    assert_one_line_error(rc, out, err, "fuselm bench needs an NVIDIA GPU (none found)")


def test_bench_arguments_are_wired():
    args = cli.build_parser().parse_args(["bench", "smollm2-135m", "--no-fuse", "--runs", "2"])
    assert args.models == ["smollm2-135m"] and args.no_fuse and args.runs == 2
    args = cli.build_parser().parse_args(["inspect", "x", "--no-fuse", "--compile"])
    assert args.no_fuse and args.compile and args.arch == "sm_90" and not args.json


def test_prefill_shows_the_batched_prefill_graph(capsys, tmp_path):
    """--prefill: the state-only graph of a prompt step (the largest step size unless named), its
    GEMVs as gemm kernels over its tokens and flash attention a block per KV head and tokens; the last
    layer keeps only its K and V projections; --out writes those kernels."""
    TOKENS = Tuning().prefill_tokens[0]
    rc, out, _ = run_main(capsys, "inspect", "smollm2-135m", "--prefill", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["tokens"] == TOKENS
    launches = doc["launches"]
    assert {l["family"] for l in launches} == {"rowwise", "gemm", "attention"}
    # attention: flash attention, a block per KV head and 21 tokens (SmolLM2's 3 query heads a KV
    # head: 63 of a block's 64 query rows)
    assert all(l["grid"] == [3, -(-TOKENS // 21)] and l["function"].endswith("_flash_" + l["function"].split("_flash_")[1])
               for l in launches if l["family"] == "attention")
    # each gemm kernel launches its vectors' stage first (one block per token), then the gemm
    gemms = [l for l in launches if l["family"] == "gemm"]
    assert all(stage["function"] == gemm["kernel"] + "_stage" and gemm["function"] == gemm["kernel"]
               and stage["kernel"] == gemm["kernel"] and stage["grid"][0] == TOKENS
               for stage, gemm in zip(gemms[::2], gemms[1::2]))
    last = [l for l in launches if l["layer"] == 29]
    assert [l["function"] for l in last] == [last[1]["function"] + "_stage", last[1]["kernel"]]
    assert sum(n.startswith("linear_") for n in last[1]["nodes"]) == 2                    # K and V only
    assert sum(n.startswith("kv_write_") for n in last[1]["nodes"]) == 2
    assert len(launches) == 1 + 29 * (5 + 4) + 2    # embedding, 29 whole layers, the last one's K and V
    rc, out, _ = run_main(capsys, "inspect", "smollm2-135m", "--prefill", "--out", str(tmp_path))
    assert rc == 0 and f"a prefill step of {TOKENS} tokens" in out
    assert "kernels in layer 0: 5 (+4 gemm stage)" in out and "kernels in layer 29: 1 (+1 gemm stage)" in out
    # few row tiles (N 576 to 3072): every wgmma kernel cuts the step's tokens, none splits its k
    assert "column tiles: 5 of 5 gemm kernels give a block part of the step's tokens" in out and "split-K" not in out
    assert any(f.name.startswith("gemm_") for f in tmp_path.iterdir())
    rc, out, _ = run_main(capsys, "inspect", "--prefill", "--prefill-tokens", "16", "smollm2-135m", "--json")
    assert rc == 0 and json.loads(out)["tokens"] == 16
    for bad in ("12", "1032", "0"):
        assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", "--prefill", "--prefill-tokens", bad),
                              f"--prefill-tokens takes a step of 8 to 1024 tokens, a multiple of 8; got {bad}")
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", "--prefill-tokens", "32"),
                          "--prefill-tokens needs --prefill")


def test_prefill_end_shows_the_step_that_ends_a_prompt(capsys):
    """--prefill --prefill-end: the step's form with every token's logits: the whole last layer,
    and the LM head (its final norm as prologue) as the last gemm over the step's tokens."""
    rc, out, _ = run_main(capsys, "inspect", "smollm2-135m", "--prefill", "--prefill-tokens", "32", "--prefill-end",
                          "--json")
    assert rc == 0
    doc = json.loads(out)
    launches = doc["launches"]
    assert doc["tokens"] == 32 and len(launches) == 1 + 30 * (5 + 4) + 2
    assert launches[-2]["function"] == launches[-1]["kernel"] + "_stage"
    assert launches[-1]["function"].startswith("gemm_norm_k576_1x49152_t32")
    assert any(n.startswith("rmsnorm_") for n in launches[-1]["nodes"])
    rc, out, _ = run_main(capsys, "inspect", "smollm2-135m", "--prefill", "--prefill-end")
    assert rc == 0 and "a prefill step of 256 tokens ending a prompt" in out
    assert_one_line_error(*run_main(capsys, "inspect", "smollm2-135m", "--prefill-end"),
                          "--prefill-end needs --prefill")


def test_prefill_of_a_model_without_one_is_one_error_line(capsys, tmp_path):
    config = tmp_path / "config.json"      # rows of 36 weights: no gemm form
    config.write_text(json.dumps(dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=36,
                                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=3,
                                      num_key_value_heads=1)))
    assert_one_line_error(*run_main(capsys, "inspect", str(config), "--prefill"),
                          "LlamaForCausalLM has no batched prefill")
