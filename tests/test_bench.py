"""The benchmarks' matched-setting code runs on today's package (the benchmarks themselves are not in the suite).

`bench/vs_trl.py` feeds TRL our prompts and scores TRL's completions with our env's turn function; both reach
into the rollout, so a change there must not leave the benchmark broken. Its FLOP count of our update reads the
shapes of the model's forward calls, so it is checked against hand-counted shapes of the real forward path.
TRL itself is not needed here. `bench/memory_model.py`'s budget is pinned term by term (float32 state, the
compute dtype, checkpointing, the probe's chunks), and docs/multi-device.md's memory table must be the one it prints.
"""

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from rldynamics.config import make_config
from rldynamics.models.forward import token_logprobs
from rldynamics.models.loading import load_model_and_tokenizer
from rldynamics.models.tiny import build_tiny_model, build_tiny_tokenizer
from rldynamics.train.warmstart import tiny_corpus

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _imported(name: str):
    """The bench script `name` imported as a module, with bench/ on the path while the fixture lives."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def vs_trl():
    yield from _imported("vs_trl")


@pytest.fixture(scope="module")
def paired_steps():
    yield from _imported("paired_steps")


def test_paired_steps_sets_the_baseline_environment_on_top_of_its_own(paired_steps, monkeypatch):
    """`--baseline-env KEY=VALUE` reaches the baseline's processes over the one-process environment and its
    checkout's path; a malformed entry is refused by name."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    extra = paired_steps.parse_env(["THP_MEM_ALLOC_ENABLE=1", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"])
    assert extra == {"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = paired_steps.side_env(Path("/base/src"), extra)
    assert (env["PYTHONPATH"], env["OMP_NUM_THREADS"], env["THP_MEM_ALLOC_ENABLE"]) == ("/base/src", "1", "1")
    assert "THP_MEM_ALLOC_ENABLE" not in paired_steps.side_env(Path("/ours/src"))
    for bad in ("THP_MEM_ALLOC_ENABLE", "=1", "A B=1"):
        with pytest.raises(ValueError, match=f"--baseline-env {bad!r}: expected KEY=VALUE"):
            paired_steps.parse_env([bad])


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tiny_tokenizer(tiny_corpus(make_config().env, num_seeds=20))


def test_vs_trl_prompts_tokenise_alike_and_replies_score_as_the_env_says(vs_trl, tiny_tokenizer):
    cfg = make_config()
    tokenizer = tiny_tokenizer
    model = build_tiny_model(tokenizer)
    rows, ctx, names = vs_trl.sokoban_rows(tokenizer, model, 2, 1)  # raises if TRL's path tokenises differently
    assert [r["seed"] for r in rows] == [cfg.train.seed_base, cfg.train.seed_base + 1]
    assert len({r["prompt"] for r in rows}) == 2

    garbage = tokenizer("no tags here")["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert vs_trl.sokoban_score(ctx, names, rows[0]["seed"], garbage) == cfg.env.format_penalty
    move = tokenizer("<answer>Up</answer>")["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert vs_trl.sokoban_score(ctx, names, rows[0]["seed"], move) != cfg.env.format_penalty


def _memory_model(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("memory_model")


def test_memory_model_keeps_state_float32_and_computes_in_the_compute_dtype(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["3b"]
    full, mixed = (mm.budget(mm.Setup(arch, dtype=d, world=1, micro_rows=1)) for d in ("float32", "bfloat16"))
    for key in ("weights", "optimizer", "grads", "analysis"):  # float32 whatever the compute dtype
        assert mixed[key] == full[key], key
    assert full["weights"] == 2 * arch.params * 4 and full["optimizer"] == 2 * arch.params * 4
    assert mixed["kv_cache"] == full["kv_cache"] / 2
    # bfloat16: the norms' values and the log-softmax chunk stay float32, the rest halves, autocast casts each
    # projection's input on its own (3h more) and holds a bfloat16 copy of the weights
    tokens, h = 2048, arch.hidden
    layer = (4 * h + 2 * arch.kv + 4 * arch.intermediate) * 4 - (7 * h + 2 * arch.kv + 4 * arch.intermediate) * 2
    logits = tokens * 0.25 * arch.vocab
    assert full["activations"] - mixed["activations"] == pytest.approx(
        tokens * arch.layers * layer + logits * 2 * 2 - 2 * arch.params)


def test_memory_model_checkpointing_keeps_one_block_input_per_layer(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["0.5b"]
    plain, ckpt = (mm.budget(mm.Setup(arch, dtype="float32", checkpointing=c, micro_rows=2, tokens=1024))
                   for c in (False, True))
    block = (8 * arch.hidden + 2 * arch.kv + 4 * arch.intermediate) * 4 * 2 * 1024  # one block's saved values
    assert plain["activations"] - ckpt["activations"] == pytest.approx(
        (arch.layers - 1) * block - arch.layers * arch.hidden * 4 * 2 * 1024)


def test_memory_model_chunked_probe_holds_one_chunk(monkeypatch):
    mm = _memory_model(monkeypatch)
    arch = mm.ARCHS["3b"]
    whole, chunked = (mm.budget(mm.Setup(arch, world=1, chunks=c)) for c in (1, 8))
    per_coordinate = (2 * 3 + 1) * 4 + 5  # 2 x 3 term vectors, the term differentiated, the sketch tables
    head = min(4 * 2048 * 0.25 * arch.vocab, mm.CHUNK_ELEMENTS) * 4 * 4  # kept for the other terms (retain_graph)
    assert whole["analysis"] == pytest.approx(arch.params * per_coordinate + head)
    assert chunked["analysis"] == pytest.approx(max(arch.params / 8, arch.vocab * arch.hidden) * per_coordinate + head)
    assert mm.budget(mm.Setup(arch, world=1, chunks=100))["analysis"] == pytest.approx(
        arch.vocab * arch.hidden * per_coordinate + head)  # no chunk is smaller than the embedding


def test_readme_memory_table_is_the_models(monkeypatch):
    mm = _memory_model(monkeypatch)
    readme = (BENCH.parent / "docs" / "multi-device.md").read_text().splitlines()
    table = mm.table().splitlines()
    start = readme.index(table[0])
    assert readme[start:start + len(table)] == table


@pytest.mark.real_model
@pytest.mark.slow
def test_vs_trl_smollm2_prompts_in_its_own_template_tokenise_alike(vs_trl, smollm2_dir):
    model, tokenizer = load_model_and_tokenizer(smollm2_dir)
    rows, ctx, _ = vs_trl.sokoban_rows(tokenizer, model, 2, 2)  # raises if TRL's path tokenises differently
    assert len(rows) == 4
    for row in rows:
        assert row["prompt"].startswith("<|im_start|>system\n") and row["prompt"].endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ctx.chat.stop_ids


def test_update_flops_formula_on_a_hand_case(vs_trl):
    shape = vs_trl.ModelShape(params=0, body=10, hidden=2, vocab=3, layers=1, attn=2)
    # 6 x 10 x (2 x 3) + 6 x 2 x 3 x 4 + 12 x 1 x 2 x (2 x 3) x 5
    assert vs_trl.forward_backward_flops(shape, rows=2, new=3, keys=5, head=4) == 360 + 144 + 720


@pytest.mark.parametrize("tied", [True, False])
def test_model_shape_counts_the_body_by_hand(vs_trl, tiny_tokenizer, tied):
    model = build_tiny_model(tiny_tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, tie_embeddings=tied)
    vocab = model.config.vocab_size
    # per layer: q 64x64 + 64 bias, k and v 64x32 + 32 bias each, o 64x64, MLP 3 x 64x128, two norms; a final norm
    layer = (4096 + 64) + 2 * (2048 + 32) + 4096 + 3 * 64 * 128 + 2 * 64
    shape = vs_trl.model_shape(model)
    assert shape.body == 2 * layer + 64
    assert shape.params == shape.body + (1 if tied else 2) * vocab * 64
    assert (shape.hidden, shape.vocab, shape.layers, shape.attn) == (64, vocab, 2, 64)


def test_update_flops_counts_the_update_forwards_per_step(vs_trl, tiny_tokenizer):
    """Shared prompts: the prefix forward (2 prompts of 5) and the suffix forward (4 rows of 3 on the cache);
    without sharing: 4 whole rows of 8. Forwards without gradients count nothing and end a step."""
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    torch.manual_seed(0)
    prompts = torch.randint(5, 100, (2, 5))  # [2, 5]
    ids = torch.cat([prompts.repeat_interleave(2, 0), torch.randint(5, 100, (4, 3))], 1)  # [4, 8]
    attn = torch.ones_like(ids)  # [4, 8]
    response = torch.zeros_like(ids)
    response[:, 5:] = 1  # [4, 8]
    counter = vs_trl.UpdateFlops()
    try:
        for shared in (True, False):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=attn)  # generation's stand-in: starts the next step
            logprobs, _ = token_logprobs(model, ids, attn, positions=response, shared_prefix=shared)
            logprobs.sum().backward()
    finally:
        counter.close()
    shape, fb = counter.shape, vs_trl.forward_backward_flops
    assert shape == vs_trl.model_shape(model)
    assert counter.tokens == [2 * 5 + 4 * 3, 4 * 8]
    # the head at the kept positions: the last prefix position, then the suffix's first two
    assert counter.flops == [fb(shape, rows=2, new=5, keys=5, head=2) + fb(shape, rows=4, new=3, keys=8, head=8),
                             fb(shape, rows=4, new=8, keys=8, head=12)]
    model(input_ids=ids, attention_mask=attn).logits.sum().backward()
    assert counter.tokens == [2 * 5 + 4 * 3, 4 * 8]  # closed: the hooks are gone


def test_vs_trl_report_takes_medians_the_best_matmul_and_their_ratio(vs_trl, capsys):
    got = {"ours": [1.0, 2.0, 9.0], "trl": [4.0, 8.0, 5.0], "rates": [3e9, 1e9, 2e9], "tokens": [700, 760, 740],
           "matmul": [5e9, 8e9], "params": 134_515_008,
           "phases": {"gen": [0.5, 0.5, 0.6], "old_log_prob": [], "adv": [0.0, 0.0, 0.0], "update_actor": [1.5, 1, 2]}}
    row = vs_trl.report("smollm2", "2 x 8", "float32", 1536, got)
    assert row == {"model": "smollm2 (134.52M)", "batch": "2 x 8", "dtype": "float32", "our engine": "hf",
                   "ours s/step": "2.000", "TRL s/step": "5.000", "TRL/ours": "2.50",
                   "our phases": "gen 25%, update_actor 75%",
                   "update GFLOP/s": "2.00", "matmul GFLOP/s": "8.00", "update/matmul": "0.25"}
    assert "update 2.00 GFLOP/s (740 token positions per step)  matmul 8.00 GFLOP/s (1536x1536 float32" in \
        capsys.readouterr().out


def test_an_optimizer_step_closes_a_counted_step(vs_trl, tiny_tokenizer):
    """With the vLLM engine no forward runs without gradients between two updates: the optimizer step ends each."""
    model = build_tiny_model(tiny_tokenizer, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                             intermediate_size=64)
    ids = torch.randint(5, 100, (2, 6))  # [2, 6]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    counter = vs_trl.UpdateFlops()
    try:
        with torch.no_grad():
            model(input_ids=ids)  # generation in the first step: the counter finds the model
        for _ in range(2):
            model(input_ids=ids).logits.sum().backward()
            optimizer.step()
    finally:
        counter.close()
    assert counter.tokens == [12, 12]


def test_vs_trl_report_prints_the_baseline_against_ours(vs_trl, capsys):
    got = {"ours": [2.0], "trl": [], "baseline": [3.0, 3.0], "rates": [1e9], "tokens": [700], "matmul": [2e9],
           "params": 1_000_000, "phases": {"update_actor": [1.0]}, "baseline_phases": {"update_actor": [2.0, 2.0]}}
    row = vs_trl.report("tiny", "8 x 8", "float32", 256, got)
    assert (row["baseline s/step"], row["baseline/ours"], row["TRL s/step"]) == ("3.000", "1.50", "nan")
    assert "baseline 3.000 s/step  baseline/ours 1.50  by phase: update_actor 2.000s" in capsys.readouterr().out


@pytest.fixture(scope="module")
def atlas():
    yield from _imported("atlas")


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_atlas_dates_the_fall_and_the_lead_from_the_logged_rows(atlas, tmp_path):
    """Start = the validation before training (40 %); success fell at the first step >= 2 with it and the next step
    both below 30 %: step 4 (step 2's 25 % is followed by 35 %); the first rule fired at step 2: lead +2."""
    run = tmp_path / "runs" / "blowup"
    run.mkdir(parents=True)
    success = {1: 0.5, 2: 0.25, 3: 0.35, 4: 0.1, 5: 0.0}
    rows = [{"step": 0, "val-env/math/success": 0.4, "val-env/math/success_se": 0.05}]
    rows += [{"step": s, "train/math/success": v, "actor/entropy": 1.0 / s} for s, v in success.items()]
    rows[-1].update({"val-env/math/success": 0.1, "val-env/math/success_se": 0.03, "early_stopped/x": 1.0})
    _write_rows(run / "metrics.jsonl", rows)
    _write_rows(run / "events.jsonl", [{"step": 2, "rule": "truncation", "action": "warn"},
                                       {"step": 4, "rule": "truncation", "action": "warn"},
                                       {"step": 4, "rule": "entropy_collapse", "action": "stop"}])
    s = atlas.summarize(run)
    assert s["train_start"] == 0.4 and s["fell"] == 4 and s["lead"] == 2
    assert s["fired"] == {"truncation": (2, "warn"), "entropy_collapse": (4, "stop")}
    assert s["ended"] == "stopped: x" and s["val"][-1] == (5, 0.1, 0.03)
    line = atlas.table(tmp_path / "runs").splitlines()[-1]
    assert line.startswith("| blowup | 5 | 40.0 / 0.0 / 0.0 | 40.0 -> 10.0 (± 3.0, step 5) | 4 |")
    margins = atlas.margins(tmp_path / "runs").splitlines()[-1]
    assert margins.startswith("| blowup | 0.438 |")  # entropy 1/s: min 0.2 over the first five's mean 0.457


@pytest.fixture(scope="module")
def echo_trap():
    yield from _imported("echo_trap")


def test_echo_trap_finds_the_peak_the_fall_and_the_freeze_from_the_logged_rows(echo_trap, tmp_path):
    """Validation 30 % -> 50 % at step 20 -> 20 %: the peak is 3.5 SE above the start, step 30 the first validation
    2 SE below it (40 % is only 1.4 below); the first-turn MI halves at step 25 (0.4 < 0.5 x 1.0), the entropy at
    step 30 (0.2 < 0.5 x the first five's mean 1.0); the first warning at step 22 leads the fall by 8 steps."""
    run = tmp_path / "frozenlake-tiny-none" / "frozenlake-tiny" / "seed0"
    run.mkdir(parents=True)
    val = {0: (0.3, 0.04), 10: (0.4, 0.05), 20: (0.5, 0.04), 25: (0.42, 0.04), 30: (0.2, 0.04)}
    rows = [{"step": s, "actor/entropy": 1.0 if s < 30 else 0.2,
             "collapse_first_turn_sample/mi_estimate": 1.0 if s < 25 else 0.4} for s in range(1, 31)]
    rows = [{"step": 0}, *rows]
    for s, (x, se) in val.items():
        rows[s].update({"val-env/frozenlake/success": x, "val-env/frozenlake/success_se": se})
    _write_rows(run / "metrics.jsonl", rows)
    _write_rows(run / "events.jsonl", [{"step": 5, "rule": "reward_component", "action": "record"},
                                       {"step": 22, "rule": "entropy_collapse", "action": "warn"}])
    s = echo_trap.summarize(run)
    assert (s["peak"], s["peak_step"], s["end"], s["fall_step"]) == ((0.5, 0.04), 20, (0.2, 0.04), 30)
    assert s["trapped"] and (s["mi_froze"], s["entropy_froze"]) == (25, 30)
    assert s["first_rule"] == ("entropy_collapse", 22) and s["lead"] == 8
    assert s["fall_se"] == pytest.approx(0.3 / (0.04 * 2**0.5))
    means = "| frozenlake-tiny | none | 1 | 30.0 ± nan | 50.0 ± nan | 20.0 ± nan | 1 of 1 | - | - |"
    assert means in echo_trap.table(tmp_path)


@pytest.fixture(scope="module")
def rescue():
    yield from _imported("rescue")


def test_rescue_counts_a_rollback_that_a_later_rollback_archived(rescue, tmp_path):
    """A rollback to step 15, then one to step 10: the second archives the rows after step 10, the first rollback's
    event among them (rolled_back/attempt_2); both are counted, in the order made."""
    run = tmp_path / "run"
    (run / "rolled_back" / "attempt_2").mkdir(parents=True)
    (run / "rolled_back" / "attempt_1").mkdir()
    first = {"step": 15, "rule": "rollback", "action": "rollback", "archive": "attempt_1", "changes": {"x": [1, 0]}}
    _write_rows(run / "events.jsonl", [{"step": 10, "rule": "rollback", "action": "rollback", "archive": "attempt_2"}])
    _write_rows(run / "rolled_back" / "attempt_2" / "events.jsonl",
                [first, {"step": 16, "rule": "entropy_surge", "action": "rollback"}])
    _write_rows(run / "rolled_back" / "attempt_1" / "events.jsonl", [{"step": 19, "rule": "entropy_surge",
                                                                      "action": "rollback"}])
    assert [(e["step"], e["archive"]) for e in rescue.rollbacks(run)] == [(15, "attempt_1"), (10, "attempt_2")]


def test_rescue_judges_the_policy_a_run_leaves_by_its_last_checkpoint(rescue, tmp_path):
    """A run that validated at steps 0 and 10 and left the state of step 0 as its last checkpoint (a rollback rule
    with no rollback left) is judged by its step-0 validation; one whose last checkpoint is step 10, by step 10's; one
    without checkpoints, by its last validation."""
    run = tmp_path / "run"
    run.mkdir()
    val = "val-env/math/success"
    _write_rows(run / "metrics.jsonl", [{"step": 0, val: 0.4}, {"step": 1, "x": 1.0}, {"step": 10, val: 0.1}])
    assert rescue.left_success(run) == 0.1
    (run / "checkpoints" / "step_0").mkdir(parents=True)
    assert rescue.left_success(run) == 0.4
    (run / "checkpoints" / "step_10").mkdir()
    assert rescue.left_success(run) == 0.1


def test_every_rescue_scenario_and_arm_is_a_valid_run_whose_remedy_changes_what_it_names(rescue):
    """Each (scenario, arm) is a config `rldyn train` accepts, with the acting rule set as the arm says; each
    remedy changes a setting (but on `control_math`, whose entropy bonus is already off); the SmolLM2 blow-up's
    remedy goes back to the preset's own learning rate."""
    from rldynamics.config import apply_remedy, make_config

    action = {"none": "record", "stop": "stop", "rollback": "rollback", "back_stop": "rollback", "remedy": "rollback",
              "filter": "record"}
    for scenario, (preset, overrides, rule, remedy) in rescue.SCENARIOS.items():
        for arm, settings in rescue.ARMS.items():
            cfg = make_config(preset, None, [*overrides, *settings(rule, remedy)])
            assert getattr(cfg.health, rule) == action[arm], (scenario, arm)
        _, changes = apply_remedy(make_config(preset, None, [*overrides, f"health.remedy=[{remedy}]"]))
        assert bool(changes) != scenario.startswith("control_math"), (scenario, remedy)  # its bonus is already 0
    _, overrides, _, remedy = rescue.SCENARIOS["blowup_smollm2"]
    _, changes = apply_remedy(make_config("math-smollm2", None, [*overrides, f"health.remedy=[{remedy}]"]))
    assert changes["train.lr"] == pytest.approx((1e-3, make_config("math-smollm2", None, []).train.lr))


def test_echo_trap_replies_counts_the_common_reply_and_the_arm_named_first(echo_trap, tmp_path):
    run = tmp_path / "bandit-smollm2-none" / "bandit-smollm2" / "seed0"
    run.mkdir(parents=True)
    _write_rows(run / "metrics.jsonl", [{"step": 0, "val-env/bandit/success": 0.5, "val-env/bandit/success_se": 0.1},
                                        {"step": 1, "val-env/bandit/success": 0.5, "val-env/bandit/success_se": 0.1}])
    chat = "<|im_start|>user\nArms: {} and {}. Which arm do you pull?<|im_end|>\n<|im_start|>assistant\n{}<|im_end|>"
    picks = [("Teacher", "Trader", "<answer>Trader</answer>"), ("Nurse", "Pilot", "<answer>Nurse</answer>"),
             ("Pilot", "Nurse", "<answer> Nurse </answer>"), ("Clerk", "Artist", "<answer>Artist</answer>")]
    _write_rows(run / "samples.jsonl", [{"step": 1, "text": chat.format(*p)} for p in picks])
    row = echo_trap.replies(tmp_path).splitlines()[-1]
    assert row == "| bandit-smollm2-none/seed0 | 1-10 | 4 | 25% | 25% |"  # 4 distinct replies; only Nurse, Pilot


@pytest.fixture(scope="module")
def compile_bench():
    yield from _imported("compile")


@pytest.mark.parametrize("arm", ["mlp", "block"])
def test_compile_bench_compiles_exactly_its_regions_of_every_block(compile_bench, tiny_tokenizer, arm):
    """`bench/compile.py` finds the decoder blocks of a loaded model and marks only its arm's modules for
    compilation (lazily: nothing compiles until a call)."""
    model = build_tiny_model(tokenizer=tiny_tokenizer, num_layers=2)
    compile_bench.compile_regions(model, arm)
    compiled = {name for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    per_block = ["mlp", "input_layernorm", "post_attention_layernorm"] if arm == "mlp" else [""]
    assert compiled == {f"model.layers.{i}" + (f".{p}" if p else "") for i in range(2) for p in per_block}


@pytest.fixture(scope="module")
def figures():
    yield from _imported("figures")


def test_figures_bench_digests_the_pngs_each_side_drew(figures, tmp_path, capsys):
    """Two sides that draw the same figures get the same digests of the files and of the report's images, which is
    how `bench/figures.py` says whether a change kept the bytes."""
    from test_plots import make_run

    run = make_run(tmp_path / "run", analysis=())  # the curves and the health timeline: a few figures
    for side in ("a", "b"):
        figures.worker(run, tmp_path / side)
    a, b = (json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{"))
    assert a["pngs"] >= 2 and a["images"] >= 2 and a["plot_s"] > 0 and a["report_s"] > 0
    assert (a["files"], a["embedded"]) == (b["files"], b["embedded"])
