"""Re-ranking after the exact search (eval.rerank: qe, kr): hand-worked examples, and the metrics against a
loop-by-loop reference that transcribes the k-reciprocal authors' code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dmltrain.evaluate.rerank import Rerank, kr_distances, universe_cosines
from dmltrain.evaluate.retrieval import retrieval_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def unit_at(degrees: float) -> list[float]:
    return [math.cos(math.radians(degrees)), math.sin(math.radians(degrees))]


def test_query_expansion_hand_worked():
    # The query q = (1, 0); the gallery, in index order:
    #   g0 = (0.7071, 0.7071)  label A   cos(q, g0) = 0.7071
    #   g1 = (0.8, -0.6)       label B   cos(q, g1) = 0.8
    #   g2 = (0.96, 0.28)      label A   cos(q, g2) = 0.96
    # Plain order: g2, g1, g0. The A items rank 1 and 3; R = 2, so MAP@R counts the top 2 only:
    # (P(1)·1 + P(2)·0) / 2 = 0.5, R-precision 1/2.
    # Average QE over the n = 1 nearest: q' ∝ q + g2 = (1.96, 0.28). Dot products with q' (the norm does not
    # change the order): g2: 1.96·0.96 + 0.28·0.28 = 1.96; g0: (1.96 + 0.28)·0.7071 = 1.5839;
    # g1: 1.96·0.8 - 0.28·0.6 = 1.40. New order g2, g0, g1: MAP@R = (1/1 + 2/2) / 2 = 1, R-precision 1.
    q = np.array([[1.0, 0.0]], np.float32)
    g = np.array([[0.5**0.5, 0.5**0.5], [0.8, -0.6], [0.96, 0.28]], np.float32)
    ql, gl = np.array([0]), np.array([0, 1, 0])
    rr = Rerank("qe", candidates=3, qe_k=1)
    m = retrieval_metrics(q, ql, g, gl, ks=[1, 2], nmi=False, rerank=rr)
    assert m["map@r"] == 0.5 and m["r_precision"] == 0.5 and m["recall@1"] == 1
    assert m["rerank/map@r"] == 1 and m["rerank/r_precision"] == 1 and m["rerank/recall@2"] == 1
    cands = torch.from_numpy(g[[2, 1, 0]])[None]  # in the plain order
    scores = cands[0] @ torch.from_numpy(q[0])
    perm = rr.order(torch.from_numpy(q), cands, scores[None], torch.tensor([[2, 1, 0]]))
    assert perm.tolist() == [[0, 2, 1]]  # plain positions: g2, then g0 (plain 3rd), then g1
    # with 2 candidates only g2 and g1 are re-ranked (and stay), g0 keeps rank 3
    m2 = retrieval_metrics(q, ql, g, gl, ks=[1, 2], nmi=False, rerank=Rerank("qe", candidates=2, qe_k=1))
    assert m2["rerank/map@r"] == 0.5


def test_k_reciprocal_hand_worked():
    # Unit vectors at angles (degrees): the query q at 0; the gallery A 10 (index 0), B -14 (1), C 15 (2),
    # D 18 (3). Plain order by cosine: A, B, C, D. k1 = 2 (each item's 3 nearest, itself included), k2 = 1
    # (no local expansion), λ = 0.3.
    #   nearest 3:  q: q A B   A: A C D   B: B q A   C: C D A   D: D C A
    #   k-reciprocal R(·, 2): R(q) = {q, B} (A's list lacks q), R(B) = {B, q}, R(A) = R(C) = R(D) = {A, C, D}
    #   half sets R(·, 1) (2 nearest, mutual): {q}, {B}, {A}, {C, D}, {D, C}: each lies within the set that
    #   holds it, so the expansion adds nothing.
    # V_q and V_B live on {q, B}, V_A, V_C, V_D on {A, C, D}: the Jaccard distance from q is 1 for A, C, D.
    # Distances d = 2 - 2 cos, each row divided by its largest:
    #   row q: d(q,A) = 0.030384, d(q,B) = 0.059418, d(q,C) = 0.068148, d(q,D) = 0.097887 (the largest)
    #          so d̂(q,A) = 0.3104, d̂(q,B) = 0.6070, d̂(q,C) = 0.6962, d̂(q,D) = 1
    #   row B: d(B,q) = 0.059418, largest d(B,D) = 2 - 2 cos 32° = 0.303904, so d̂(B,q) = 0.1955
    # V_q = (q: 1, B: e^-0.6070 = 0.5450) / 1.5450 = (0.6473, 0.3527); V_B = (B: 1, q: e^-0.1955 = 0.8224) / 1.8224
    #   = (0.5487, 0.4513). Σ min = 0.4513 + 0.3527 = 0.8040; d_J(q, B) = 1 - 0.8040 / (2 - 0.8040) = 0.3277.
    # Final (1 - λ) d_J + λ d̂:  A 0.7 + 0.3·0.3104 = 0.7931, B 0.7·0.3277 + 0.3·0.6070 = 0.4115,
    #   C 0.7 + 0.3·0.6962 = 0.9089, D 0.7 + 0.3 = 1.0. New order: B, A, C, D.
    q = torch.tensor([unit_at(0)])
    cands = torch.tensor([[unit_at(a) for a in (10, -14, 15, 18)]])
    final = kr_distances(universe_cosines(q, cands).double(), 2, 1, 0.3)
    assert final[0].tolist() == pytest.approx([0.7931, 0.4115, 0.9089, 1.0], abs=1e-4)
    rr = Rerank("kr", candidates=4, kr_k1=2, kr_k2=1, kr_lambda=0.3)
    scores = (cands[0] @ q[0])[None]
    assert rr.order(q, cands, scores, torch.tensor([[0, 1, 2, 3]])).tolist() == [[1, 0, 2, 3]]
    # through the metrics: B shares q's label; plain rank 2, re-ranked 1
    m = retrieval_metrics(q.numpy(), [7], cands[0].numpy(), [1, 7, 2, 3], ks=[1, 2], nmi=False, rerank=rr)
    assert m["recall@1"] == 0 and m["rerank/recall@1"] == 1 and m["recall@2"] == m["rerank/recall@2"] == 1


# -- the reference ------------------------------------------------------------------------------------------
def ref_k_reciprocal(S: np.ndarray, k1: int, k2: int, lam: float) -> np.ndarray:
    """Zhong et al.'s re_ranking (their released code, loop by loop) on one set, item 0 the probe: its final
    distances to items 1..M-1. ``S``: cosines (float64). Sorting is stable (their argsort is not) so equal
    distances keep the set's order, the tie rule of the evaluation."""
    original_dist = np.maximum(2.0 - 2.0 * S, 0.0)
    original_dist = np.transpose(original_dist / np.max(original_dist, axis=0))
    V = np.zeros_like(original_dist)
    initial_rank = np.argsort(original_dist, kind="stable")
    all_num = len(S)
    for i in range(all_num):
        forward_k_neigh_index = initial_rank[i, : k1 + 1]
        backward_k_neigh_index = initial_rank[forward_k_neigh_index, : k1 + 1]
        fi = np.where(backward_k_neigh_index == i)[0]
        k_reciprocal_index = forward_k_neigh_index[fi]
        k_reciprocal_expansion_index = k_reciprocal_index
        for j in range(len(k_reciprocal_index)):
            candidate = k_reciprocal_index[j]
            half = int(np.around(k1 / 2.0))
            candidate_forward_k_neigh_index = initial_rank[candidate, : half + 1]
            candidate_backward_k_neigh_index = initial_rank[candidate_forward_k_neigh_index, : half + 1]
            fi_candidate = np.where(candidate_backward_k_neigh_index == candidate)[0]
            candidate_k_reciprocal_index = candidate_forward_k_neigh_index[fi_candidate]
            if len(np.intersect1d(candidate_k_reciprocal_index, k_reciprocal_index)) > 2.0 / 3 * len(
                candidate_k_reciprocal_index
            ):
                k_reciprocal_expansion_index = np.append(k_reciprocal_expansion_index, candidate_k_reciprocal_index)
        k_reciprocal_expansion_index = np.unique(k_reciprocal_expansion_index)
        weight = np.exp(-original_dist[i, k_reciprocal_expansion_index])
        V[i, k_reciprocal_expansion_index] = 1.0 * weight / np.sum(weight)
    if k2 != 1:
        V_qe = np.zeros_like(V)
        for i in range(all_num):
            V_qe[i, :] = np.mean(V[initial_rank[i, :k2], :], axis=0)
        V = V_qe
    temp_min = np.zeros(all_num)
    for j in range(all_num):
        temp_min[j] = np.minimum(V[0], V[j]).sum()
    jaccard_dist = 1 - temp_min / (2.0 - temp_min)
    final_dist = jaccard_dist * (1 - lam) + original_dist[0] * lam
    return final_dist[1:]


def unit(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def ref_reranked_metrics(q, ql, g, gl, rr: Rerank, ks):
    """Per query: every candidate ranked (cosine, then index, float64), the top K re-ordered by the reference
    formulas, then Recall@K, MAP@R and R-precision by their definitions."""
    self_search = g is None
    if self_search:
        g, gl = q, ql
    qu, gu = unit(q), unit(g)
    hits, ap_sum, rp_sum, n = dict.fromkeys(ks, 0), 0.0, 0.0, 0
    for i in range(len(q)):
        cand = np.array([j for j in range(len(g)) if not (self_search and j == i)])
        s = gu[cand] @ qu[i]
        ranked = cand[np.lexsort((cand, -s))]
        top = ranked[: rr.candidates]
        if rr.kind == "qe":
            w = np.sort(s)[::-1][: rr.qe_k]
            w = np.ones_like(w) if rr.qe_alpha == 0 else np.maximum(w, 0) ** rr.qe_alpha
            expanded = qu[i] + (w[:, None] * gu[top[: rr.qe_k]]).sum(0)
            new = -(gu[top] @ (expanded / np.linalg.norm(expanded)))
        else:
            u = np.vstack([qu[i], gu[top]])
            new = ref_k_reciprocal(u @ u.T, rr.kr_k1, rr.kr_k2, rr.kr_lambda)
        ranked = np.concatenate([top[np.lexsort((top, new))], ranked[rr.candidates :]])
        rel = [gl[j] == ql[i] for j in ranked]
        R = sum(rel)
        if R == 0:
            continue
        n += 1
        for k in ks:
            hits[k] += any(rel[:k])
        correct, ap = 0, 0.0
        for pos in range(1, R + 1):
            if rel[pos - 1]:
                correct += 1
                ap += correct / pos
        ap_sum += ap / R
        rp_sum += sum(rel[:R]) / R
    out = {f"rerank/recall@{k}": hits[k] / n for k in ks}
    out["rerank/map@r"], out["rerank/r_precision"] = ap_sum / n, rp_sum / n
    return out


def test_kr_distances_match_the_authors_code():
    rng = np.random.default_rng(3)
    for m, d, k1, k2, lam in [(12, 4, 3, 2, 0.3), (21, 6, 5, 3, 0.1), (9, 3, 20, 6, 0.5), (16, 8, 4, 1, 0.0)]:
        x = unit(rng.standard_normal((3 * m, d))).reshape(3, m, d)
        S = np.einsum("bmd,bnd->bmn", x, x)
        got = kr_distances(torch.from_numpy(S), k1, k2, lam).numpy()
        want = np.stack([ref_k_reciprocal(s, k1, k2, lam) for s in S])
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize(
    "rr",
    [
        Rerank("qe", candidates=8, qe_k=2),
        Rerank("qe", candidates=15, qe_k=3, qe_alpha=3.0),
        Rerank("kr", candidates=12, kr_k1=4, kr_k2=2, kr_lambda=0.3),
    ],
    ids=["aqe", "alpha-qe", "kr"],
)
@pytest.mark.parametrize("gallery", [False, True], ids=["self", "query-gallery"])
def test_reranked_metrics_match_the_reference(rr, gallery):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((90, 6)).astype(np.float32)
    y = rng.integers(0, 15, 90)
    q, ql, g, gl = (x[:30], y[:30], x[30:], y[30:]) if gallery else (x, y, None, None)
    ks = [1, 2, 4, 8, 20]
    got = retrieval_metrics(q, ql, g, gl, ks=ks, nmi=False, rerank=rr, block_bytes=4 * 90 * 7)  # blocks of 7 rows
    want = ref_reranked_metrics(q, ql, g, gl, rr, ks)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got[f"rerank/recall@{ks[-1]}"] == got[f"recall@{ks[-1]}"]  # beyond the candidates nothing moves
    assert any(got[f"rerank/{k}"] != got[k] for k in ("recall@1", "recall@2", "map@r", "r_precision"))


def test_eval_command_and_config(tmp_path, capsys):
    import json

    from dmltrain.cli import main
    from dmltrain.config import load_config
    from dmltrain.errors import ConfigError
    from dmltrain.evaluate.store import save_embeddings

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((60, 8)).astype(np.float32), np.arange(60) % 12
    save_embeddings(tmp_path, "test", x, y)
    argv = ["eval", "-", "--embeddings", str(tmp_path), "--no-nmi", "--ks", "1,5", "--rerank", "kr"]
    assert main([*argv, "--rerank-param", "kr_k1=3", "--rerank-param", "candidates=10"]) == 0
    record = json.loads((tmp_path / "eval_metrics.json").read_text())
    rr = Rerank("kr", candidates=10, kr_k1=3)
    assert record["metrics"] == retrieval_metrics(x, y, ks=[1, 5], nmi=False, rerank=rr)
    assert record["rerank"]["kind"] == "kr" and "rerank %" in capsys.readouterr().out
    assert main([*argv, "--rerank-param", "kr_k1=30", "--rerank-param", "candidates=10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dmltrain: error: --rerank-param: eval.rerank_params.kr_k1: 30 exceeds the 10 candidates", err
    cfg = load_config(None, ["eval.rerank=qe", "eval.metric=rerank/map@r", "eval.rerank_params.qe_alpha=3"])
    assert cfg.eval.rerank_params.qe_alpha == 3 and "rerank/recall@1" in cfg.eval.metric_names()
    with pytest.raises(ConfigError, match="eval.metric"):
        load_config(None, ["eval.metric=rerank/map@r"])  # not reported without eval.rerank
    with pytest.raises(ConfigError, match="kr_k1"):
        load_config(None, ["eval.rerank=kr", "eval.rerank_params.kr_k1=200"])
