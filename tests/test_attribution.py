"""Attribution of a step's gradient to rows, groups and tokens (`analysis.attribution`): the shares and scores add up,
they equal an independent reference (per-row and per-token gradients by plain autograd through the whole batch's
loss with every other entry detached) and the update's own gradient norm, a planted outlier ranks first, and the
pass is read-only."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import micro_model_batch
from rldynamics import dist
from rldynamics.algo.advantages import grpo_advantages
from rldynamics.algo.losses import AGG_MODES, PolicyLossSettings, loss_terms, weighted_total
from rldynamics.analysis.attribution import Attribution, attribute
from rldynamics.analysis.objective import ActorInputs, policy_loss_settings
from rldynamics.config import make_config
from rldynamics.models.forward import token_logprobs
from rldynamics.models.precision import enable_checkpointing
from rldynamics.rollout.batch import RolloutBatch
from rldynamics.train.actor import update_actor

VOCAB, LENGTH = 64, 14
GROUPS, GROUP_SIZE = 3, 4
EMPTY_ROW = 11  # a row without response tokens (its prompt only)
REG = ["algo.entropy_coef=0.01", "algo.kl_coef=0.05", "algo.kl_type=low_var_kl"]


@pytest.fixture(scope="module", autouse=True)
def single_thread(one_thread):
    """Tiny tensors gain nothing from threads (`conftest.one_thread`)."""


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float().eval()  # sdpa attention, the default


def make_batch(scores: list[float], seed: int = 0) -> RolloutBatch:
    """3 groups x 4 rows: a group's shared 4-token prompt, a response, an observation (a pad token in every other
    row's), a second response, padding."""
    gen = torch.Generator().manual_seed(seed)
    n = GROUPS * GROUP_SIZE
    input_ids = torch.randint(3, VOCAB, (n, LENGTH), generator=gen)  # [N, L]
    for g in range(GROUPS):
        input_ids[g * GROUP_SIZE:(g + 1) * GROUP_SIZE, :4] = input_ids[g * GROUP_SIZE, :4]
    lengths = torch.randint(10, LENGTH + 1, (n,), generator=gen)  # [N]
    positions = torch.arange(LENGTH)[None, :]  # [1, L]
    attention_mask = (positions < lengths[:, None]).long()  # [N, L]
    response = ((positions >= 4) & (positions < 7)) | (positions >= 9)  # [1, L] turn 1, observation, turn 2
    response_mask = (response & attention_mask.bool()).float()  # [N, L]
    response_mask[EMPTY_ROW] = 0.0
    input_ids[~attention_mask.bool()] = 0  # the pad id
    input_ids[::2, 7] = 0  # inside an observation too: backward leaves the embedding's padding row out of g
    return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                        scores=torch.tensor(scores), group_ids=torch.arange(GROUPS).repeat_interleave(GROUP_SIZE) + 5)


SCORES = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.2, 0.3, 0.9, 0.0, 0.7]


def make_inputs(model, batch: RolloutBatch, *, old: bool, norm_by_std: bool = True) -> ActorInputs:
    """GRPO advantages of the batch's scores, reference log-probs near the model's own, old ones too or None."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        own, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, positions=batch.response_mask,
                                shared_prefix=False)  # [N, L]
    noise = torch.randn(own.shape, generator=gen)  # [N, L]
    return ActorInputs(old_logprobs=own + 0.15 * noise * batch.response_mask if old else None,
                       advantages=grpo_advantages(batch.scores, batch.group_ids, batch.response_mask, norm_by_std),
                       ref_logprobs=own + 0.2 * torch.randn(own.shape, generator=gen) * batch.response_mask)


@pytest.fixture(scope="module")
def batch():
    return make_batch(SCORES)


def settings_of(overrides: list[str]):
    cfg = make_config(overrides=overrides)
    return policy_loss_settings(cfg.algo), cfg


def run(model, batch, inputs, settings: PolicyLossSettings, micro_batch_size: int = 3) -> Attribution:
    return attribute(model, batch, inputs, settings, temperature=1.0, micro_batch_size=micro_batch_size)


# ---- the shares and scores add up -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("old", [False, True])
def test_shares_and_scores_add_up(model, batch, mode, old):
    settings, _ = settings_of([f"algo.loss_agg_mode={mode}", *REG])
    result = run(model, batch, make_inputs(model, batch, old=old), settings)
    assert result.residual < 1e-5
    assert float(result.row_share.sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(result.group_share.sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(result.token_scores.double().sum()) == pytest.approx(1.0, abs=1e-4)
    per_row = result.token_scores.double().sum(1)  # [N]
    torch.testing.assert_close(per_row, result.row_share, rtol=1e-4, atol=1e-6)
    groups = torch.stack([result.row_share[batch.group_ids == g].sum() for g in result.group_ids])  # [G]
    torch.testing.assert_close(groups, result.group_share, rtol=1e-5, atol=1e-7)
    assert result.row_share[EMPTY_ROW] == 0.0 and result.row_norm[EMPTY_ROW] == 0.0
    assert result.row_cosine[EMPTY_ROW].isnan()
    torch.testing.assert_close(result.row_cosine.nan_to_num() * result.row_norm, result.row_share * result.grad_norm)


# ---- against an independent reference and the update's own norm -------------------------------------------------


def reference(model, batch: RolloutBatch, inputs: ActorInputs, settings: PolicyLossSettings):
    """Per-row [N, P] and per-token {(row, t): score} gradients from one forward of the whole batch: the whole loss
    differentiated with every log-prob and entropy but the row's (the token's) detached; float64 dot products."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True,
                               positions=batch.response_mask, shared_prefix=False)  # [N, L] each

    def grad_of(keep: torch.Tensor) -> torch.Tensor:
        terms, _ = loss_terms(torch.where(keep, logp, logp.detach()), torch.where(keep, ent, ent.detach()),
                              inputs.old_logprobs, inputs.advantages, batch.response_mask, settings,
                              ref_logprobs=inputs.ref_logprobs)
        parts = torch.autograd.grad(weighted_total(terms, settings.coefs), params, retain_graph=True,
                                    allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                          for g, p in zip(parts, params, strict=True)])  # [P]

    rows = torch.arange(len(batch))[:, None]  # [N, 1]
    per_row = torch.stack([grad_of((rows == i).expand_as(logp)) for i in range(len(batch))])  # [N, P]
    g = per_row.sum(0)  # [P]
    cells = torch.zeros_like(logp, dtype=torch.bool)  # [N, L]
    scores = {}
    for r, t in batch.response_mask.nonzero().tolist():
        cells[r, t] = True
        scores[r, t] = float(grad_of(cells) @ g / (g @ g))
        cells[r, t] = False
    return per_row, scores


@pytest.mark.parametrize("mode", AGG_MODES)
def test_equals_the_reference_and_the_update_norm(model, batch, mode):
    settings, cfg = settings_of([f"algo.loss_agg_mode={mode}", *REG, "train.ppo_epochs=1",
                                 "train.mini_batch_size=12", "train.micro_batch_size=5"])
    inputs = make_inputs(model, batch, old=True)
    result = run(model, batch, inputs, settings)
    copied = copy.deepcopy(model)
    update = update_actor(copied, torch.optim.SGD(copied.parameters(), lr=0.0), batch, inputs, cfg.algo, cfg.train)
    assert len(update.steps) == 1
    assert result.grad_norm == pytest.approx(update.steps[0].grad_norm, rel=1e-5)

    per_row, scores = reference(model, batch, inputs, settings)  # [N, P], {(r, t): score}
    g = per_row.sum(0)  # [P]
    assert result.grad_norm == pytest.approx(float(g.norm()), rel=1e-5)
    torch.testing.assert_close(result.row_share, per_row @ g / (g @ g), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.row_norm, per_row.norm(dim=1), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.row_cosine, per_row @ g / (per_row.norm(dim=1) * g.norm()), rtol=1e-4,
                               atol=1e-6, equal_nan=True)
    per_group = torch.stack([per_row[batch.group_ids == gid].sum(0) for gid in result.group_ids])  # [G, P]
    torch.testing.assert_close(result.group_share, per_group @ g / (g @ g), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.group_norm, per_group.norm(dim=1), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(result.group_cosine, per_group @ g / (per_group.norm(dim=1) * g.norm()), rtol=1e-4,
                               atol=1e-6)
    expected = torch.zeros_like(result.token_scores)  # [N, L]
    for (r, t), score in scores.items():
        expected[r, t] = score
    torch.testing.assert_close(result.token_scores, expected, rtol=1e-3, atol=1e-6)


# ---- a planted outlier ------------------------------------------------------------------------------------------


def test_a_planted_outlier_ranks_first(model):
    scores = [0.3, 0.1, 0.4, 0.2, 0.0, 0.0, 60.0, 0.0, 0.5, 0.1, 0.2, 0.3]  # row 6: the outlier of group 6
    batch = make_batch(scores)
    settings, _ = settings_of(["algo.loss_agg_mode=seq-mean-token-mean", *REG])
    result = run(model, batch, make_inputs(model, batch, old=False, norm_by_std=False), settings)
    assert result.top_rows(3).tolist()[0] == 6 and result.top_rows(1, absolute=True).tolist() == [6]
    assert result.row_share[6] > 0.5
    assert result.top_groups(1).tolist() == [6] and result.top_groups(3).tolist()[0] == 6
    order = result.top_rows(12)
    assert (result.row_share[order].diff() <= 0).all()  # descending
    tokens = result.top_tokens(6, 4)  # [4]
    assert batch.response_mask[6, tokens].bool().all()
    magnitudes = result.token_scores[6, tokens].abs()  # [4]
    assert (magnitudes.diff() <= 0).all() and magnitudes[0] == result.token_scores[6].abs().max()
    assert len(result.top_tokens(EMPTY_ROW, 3)) == 0 and len(result.top_tokens(0, 100)) == batch.response_mask[0].sum()


# ---- read-only, the mask, checkpointing, one process ------------------------------------------------------------


def test_read_only_and_zero_outside_the_mask(model, batch):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings, _ = settings_of(["algo.loss_agg_mode=token-mean", *REG])
    result = run(model, batch, make_inputs(model, batch, old=True), settings)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert result.token_scores.dtype == torch.float32 and result.token_scores.shape == batch.response_mask.shape
    assert (result.token_scores[~batch.response_mask.bool()] == 0).all()
    assert (result.token_scores[batch.response_mask.bool()] != 0).float().mean() > 0.9
    assert (result.token_scores[EMPTY_ROW] == 0).all()


def test_checkpointing_and_micro_batch_size_change_nothing(model, batch):
    settings, _ = settings_of(["algo.loss_agg_mode=seq-mean-token-sum", *REG])
    inputs = make_inputs(model, batch, old=True)
    plain = run(model, batch, inputs, settings, micro_batch_size=12)
    checkpointed = run(enable_checkpointing(copy.deepcopy(model)), batch, inputs, settings, micro_batch_size=5)
    assert checkpointed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-5)
    torch.testing.assert_close(checkpointed.row_share, plain.row_share, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(checkpointed.token_scores, plain.token_scores, rtol=1e-3, atol=1e-7)


def test_refuses_several_processes_and_transformers_checkpointing(model, batch, monkeypatch):
    settings, _ = settings_of([])
    inputs = make_inputs(model, batch, old=False)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing_enable"):
        run(checkpointed, batch, inputs, settings)
    monkeypatch.setattr(dist, "distributed", lambda: True)
    with pytest.raises(RuntimeError, match="one process"):
        run(model, batch, inputs, settings)


def test_warns_of_no_deprecation(model, batch):
    """An attribution reads no deprecated transformers attribute (a FutureWarning is an error)."""
    settings, _ = settings_of(REG)
    inputs = make_inputs(model, batch, old=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        run(model, batch, inputs, settings)


def test_on_the_embedded_tiny_model(tiny_cache):
    """A rolled-out two-turn batch of the project's tiny Qwen2 (tied LM head, its groups sharing their prompt)."""
    model, _, batch = micro_model_batch(tiny_cache, group_size=3)
    batch.scores = torch.arange(len(batch), dtype=torch.float32) % 4  # varied rewards within every group
    advantages = grpo_advantages(batch.scores, batch.group_ids, batch.response_mask)  # [N, L]
    settings = PolicyLossSettings(entropy_coef=0.01)
    result = attribute(model, batch, ActorInputs(old_logprobs=None, advantages=advantages), settings,
                       temperature=1.0, micro_batch_size=4)
    assert result.residual < 1e-5 and result.grad_norm > 0
    assert float(result.row_share.sum()) == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(result.token_scores.double().sum(1), result.row_share, rtol=1e-4, atol=1e-6)
    assert (result.token_scores[~batch.response_mask.bool()] == 0).all()
