"""A trained drafter for the target: an EAGLE3-style head over the target's low, mid and high hidden states.

Features of position t: the outputs of decoder layers 1 and n/2 and the final normed hidden state (the lm_head's
input), concatenated [3d]. The head fuses them to d (`fuse`), then drafts autoregressively: each step mixes its
running hidden with the embedding of the last token (the target's frozen embedding), one residual SiTU-free MLP
block, and scores with the target's frozen lm_head. Step 1 after position t sees the target's features of t and the
token at t+1 and predicts t+2; later steps feed back the head's own hidden (EAGLE's feature recurrence).

Its features come from forward hooks on the target (`FeatureCapture`): a row's first decode step of a turn drafts
from the prompt's last position (captured in the prefill forward that ends the prompt, and kept with the prefix
cache's whole-prompt entry for hits), every later step from the last committed position of its verify pass.
Trained by `k3 train-drafter` (`train_drafter.py`) on the target's own rollouts, cached like the SFT base.

Drafting scores a draft vocabulary only (EAGLE-3's reduced draft vocabulary, Li et al. 2025): the tokens of the
training rollouts, most frequent first, up to `DrafterTrainConfig.draft_vocab`, scored with those rows of the frozen
lm_head. The head trains against the target's full distribution; a token outside the draft vocabulary is never
drafted (the target emits it as a correction). At K3's 163,840-token vocabulary the full head is 2.3 GB read per
draft step, as much as a few-layer target's whole step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from k3.model import K3ForCausalLM, ops
from k3.rollout.spec.tree import DraftTree

WEIGHTS = "drafter.safetensors"
META = "drafter.json"


def feature_layers(n_layers: int) -> tuple[int, int]:
    """The decoder layers whose outputs are the low and mid features (the high one is the final normed hidden)."""
    return min(1, n_layers - 1), n_layers // 2


class FeatureCapture:
    """Forward hooks on the target recording the low/mid/high features of its latest forward ([B, T, 3d])."""

    def __init__(self, model: K3ForCausalLM):
        self.model = model
        self.low, self.mid = feature_layers(model.config.num_hidden_layers)
        self.parts: dict[str, torch.Tensor] = {}
        self.handles: list = []

    def __enter__(self) -> "FeatureCapture":
        layers = self.model.model.layers
        self.handles = [layers[self.low].register_forward_hook(self._keep("low")),
                        layers[self.mid].register_forward_hook(self._keep("mid")),
                        self.model.lm_head.register_forward_pre_hook(self._keep_input("high"))]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _keep(self, name: str):
        def hook(module, args, output):
            self.parts[name] = output[0].detach()
        return hook

    def _keep_input(self, name: str):
        def hook(module, args):
            self.parts[name] = args[0].detach()
        return hook

    def features(self) -> torch.Tensor:
        return torch.cat([self.parts["low"], self.parts["mid"], self.parts["high"]], dim=-1).float()


class Fp8Linear(nn.Module):
    """A bias-free nn.Linear's weight in e4m3 with one fp32 scale per output row (k3.model.ops.fp8_weight_linear):
    the draft head's matrices at half a bf16 weight's bytes; drafting only (no gradient)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from k3_kernels.fp8_linear import quantize_weight_rows
        if linear.bias is not None:
            raise ValueError("Fp8Linear: the draft head's linears have no bias")
        q, scale = quantize_weight_rows(linear.weight.detach())
        self.register_buffer("q", q.to(linear.weight.device))
        self.register_buffer("scale", scale.to(linear.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_weight_linear(x, self.q, self.scale)


class DraftHead(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.hidden = hidden
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMS norm without a weight, in fp32 whatever x's dtype, rounded once to it (k3.model.ops.rms_norm: one
        launch on CUDA instead of five -- a draft step runs four; on CPU the plain formula)."""
        return ops.rms_norm(x, None, self.eps)

    def step(self, h: torch.Tensor, tok_emb: torch.Tensor) -> torch.Tensor:
        """(running hidden [N, d], embedding of the last token [N, d]) -> the next hidden [N, d]."""
        u = self.mix(torch.cat([self._norm(h), self._norm(tok_emb)], dim=-1))
        return u + self.down(F.silu(self.up(self._norm(u))))

    def scores(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Scores of the hidden rows h [N, d] against lm_head rows [n, d] (`lm_head_rows`: all, or the draft
        vocabulary's), in the head weight's own dtype (a bf16 K3 head is 2.3 GB: an fp32 copy per draft step cost
        more than the step), fp32 out [N, n]."""
        return F.linear(self._norm(h).to(rows.dtype), rows).float()


def lm_head_rows(target: K3ForCausalLM, vocab: list[int] | None) -> torch.Tensor:
    """The target's frozen lm_head rows a draft head scores: all of them, or the draft vocabulary's in its order."""
    w = target.lm_head.weight.detach()
    return w if vocab is None else w[torch.tensor(vocab, dtype=torch.long, device=w.device)].contiguous()


class TrainedDrafter:
    """Greedy chain drafts or top-k token trees (point masses) from a DraftHead, continuing the target's features of
    a position."""
    needs_features = True

    def __init__(self, head: DraftHead, target: K3ForCausalLM, draft_vocab: list[int] | None = None,
                 dtype: torch.dtype = torch.float32, fp8_weights: bool = False):
        """`dtype`: the head's weights and activations at draft time (SpecConfig.drafter_dtype); `fp8_weights`:
        the fuse / mix / up / down weights in e4m3 instead (`Fp8Linear`), the activations in `dtype`."""
        if fp8_weights:   # quantised from the weights as trained (the module then holds no other tensors)
            for name in ("fuse", "mix", "up", "down"):
                setattr(head, name, Fp8Linear(getattr(head, name)))
        else:
            head = head.to(dtype)
        self.head, self.target, self.dtype = head.eval(), target, dtype
        self.rows = lm_head_rows(target, draft_vocab)
        self.vocab = None if draft_vocab is None else torch.tensor(draft_vocab, dtype=torch.long,
                                                                   device=self.rows.device)
        # ("chain", rows, steps) / ("tree", rows, branching, depth) -> the draft steps as a CUDA graph
        # (`capture_graphs`); None: eager
        self.captured: dict[tuple, object] | None = None
        self._capture_trees = False

    def capture_graphs(self, capture: bool = True, trees: bool = True) -> None:
        """Run `propose_chains`' draft steps (and with `trees`, `propose_trees`' levels) as CUDA graphs
        (k3.rollout.graphs.CapturedCall), one per shape, made on first use: the same kernels, hence the same
        drafts, without the host issuing ~20 launches a step (`capture=False`: the same path run eagerly, for CPU
        tests)."""
        self.captured = {}
        self._capture = capture
        self._capture_trees = trees

    def _call(self, key: tuple, fn, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """fn(*inputs) through the captured graph of `key` (made on first use)."""
        from k3.rollout.graphs import CapturedCall
        call = self.captured.get(key)
        if call is None:
            call = self.captured[key] = CapturedCall(fn, inputs, capture=self._capture)
        return call(*inputs)

    def _top(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """The k best draft tokens of each hidden row [N, d] -> token ids [N, <= k] (argmax for k = 1)."""
        scores = self.head.scores(h, self.rows)
        k = min(k, scores.shape[-1])
        idx = scores.argmax(-1, keepdim=True) if k == 1 else torch.topk(scores, k, dim=-1).indices
        return idx if self.vocab is None else self.vocab[idx]

    @torch.no_grad()
    def propose_tokens(self, feat: torch.Tensor, last_token: int, k: int) -> list[int]:
        emb = self.target.model.embed_tokens.weight
        h = self.head.fuse(feat.to(self.dtype).view(1, -1))
        tok, out = last_token, []
        for _ in range(k):
            h = self.head.step(h, emb[tok].to(self.dtype).view(1, -1))
            tok = int(self._top(h, 1)[0, 0])
            out.append(tok)
        return out

    @torch.no_grad()
    def propose_chains(self, feats: torch.Tensor, last_tokens: list[int], ks: list[int]) -> list[list[int]]:
        """Greedy chains for several rows at once (feats [R, 3d]; row r drafts ks[r] tokens): one pass of the head
        and the lm_head per draft step for the whole group, instead of one per row."""
        if not ks or max(ks) <= 0:
            return [[] for _ in ks]
        drafts = self.launch_chains(feats, last_tokens, max(ks))
        return [d[:k] for d, k in zip(drafts.tolist(), ks)]

    @torch.no_grad()
    def launch_chains(self, feats: torch.Tensor, last_tokens: list[int], steps: int) -> torch.Tensor:
        """`propose_chains`' draft steps, left on the device: token ids [R, steps] (the caller copies them when it
        needs them; a chain's first j tokens do not depend on how many steps follow)."""
        emb = self.target.model.embed_tokens.weight
        feats = feats.to(self.dtype).view(len(last_tokens), -1)
        if emb.is_cuda:   # from pinned memory: a pageable copy may wait for the stream's queued work
            tok = torch.tensor(last_tokens, dtype=torch.long, pin_memory=True).to(emb.device, non_blocking=True)
        else:
            tok = torch.tensor(last_tokens, dtype=torch.long)
        if self.captured is None:
            return self._chain_steps(feats, tok, steps)
        return self._call(("chain", len(last_tokens), steps), lambda f, t: self._chain_steps(f, t, steps), (feats, tok))

    def _chain_steps(self, feats: torch.Tensor, tok: torch.Tensor, steps: int) -> torch.Tensor:
        """Greedy draft tokens [R, steps] from the features [R, 3d] and the rows' last tokens [R]."""
        emb = self.target.model.embed_tokens.weight
        h = self.head.fuse(feats)
        out = []
        for _ in range(steps):
            h = self.head.step(h, emb[tok].to(self.dtype))
            tok = self._top(h, 1)[:, 0]
            out.append(tok)
        return torch.stack(out, 1)

    @torch.no_grad()
    def propose_trees(self, feats: torch.Tensor, last_tokens: list[int], branching: int, depths: list[int],
                      max_nodes: int) -> list[DraftTree]:
        """`propose_tree` for several rows at once (feats [R, 3d]; row r's tree at most depths[r] deep): the full
        top-`branching` tree of every row to the deepest depth, one head + lm_head pass per level for all rows'
        nodes (`_tree_steps`: fixed shapes, a CUDA graph with `capture_graphs`), then each row keeps its
        breadth-first prefix -- the nodes above its depth, at most `max_nodes` -- as `propose_tree` grows it."""
        depth = max(depths, default=0)
        if depth <= 0:
            return [DraftTree() for _ in depths]
        emb = self.target.model.embed_tokens.weight
        feats = feats.to(self.dtype).view(len(depths), -1)
        tok = torch.tensor(last_tokens, dtype=torch.long, device=emb.device)
        if self.captured is None or not self._capture_trees:
            levels = self._tree_steps(feats, tok, branching, depth)
        else:
            levels = self._call(("tree", len(depths), branching, depth),
                                lambda f, t: self._tree_steps(f, t, branching, depth), (feats, tok))
        tokens = levels.tolist()
        width = min(branching, self.rows.shape[0])   # children a node gets (the draft vocabulary may be smaller)
        parents, level_ends, n = [], [], 1
        for _ in range(depth):   # breadth first: node j of a level is child j % width of the level above's j // width
            first = len(parents) - n if parents else 0
            parents += [-1 if not level_ends else first + j // width for j in range(n * width)]
            n *= width
            level_ends.append(len(parents))
        keep = [min(max_nodes, level_ends[d - 1]) if d > 0 else 0 for d in depths]
        return [DraftTree(tuple(t[:m]), tuple(parents[:m])) for t, m in zip(tokens, keep)]

    def _tree_steps(self, feats: torch.Tensor, tok: torch.Tensor, branching: int, depth: int) -> torch.Tensor:
        """The full top-`branching` draft tree of every row, breadth first: tokens [R, width + width^2 + ...]
        (width = branching, or the draft vocabulary's size if smaller), each node's hidden continuing its
        parent's."""
        emb = self.target.model.embed_tokens.weight
        R = feats.shape[0]
        hid = self.head.fuse(feats)[:, None]      # [R, nodes of the level above, d]
        toks = tok[:, None]
        out = []
        for _ in range(depth):
            n, d = toks.shape[1], hid.shape[-1]
            h = self.head.step(hid.reshape(R * n, d), emb[toks.reshape(-1)].to(self.dtype))
            top = self._top(h, branching)                         # [R * n, width]
            width = top.shape[1]
            toks = top.reshape(R, n * width)
            hid = h.view(R, n, 1, d).expand(R, n, width, d).reshape(R, n * width, d)
            out.append(toks)
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def propose_tree(self, feat: torch.Tensor, last_token: int, branching: int, depth: int,
                     max_nodes: int) -> DraftTree:
        """Top-`branching` tokens per node at every depth, breadth first, each child continuing its parent's
        hidden (the feature recurrence), until `max_nodes`. With branching 1 it is `propose_tokens`'s chain."""
        if branching == 1:
            return DraftTree.chain(self.propose_tokens(feat, last_token, min(depth, max_nodes)))
        emb = self.target.model.embed_tokens.weight
        tokens: list[int] = []
        parents: list[int] = []
        frontier = [(-1, last_token)]                    # (node, its token) whose children come next
        hid = self.head.fuse(feat.to(self.dtype).view(1, -1))   # [len(frontier), d]
        for _ in range(depth):
            if not frontier or len(tokens) >= max_nodes:
                break
            toks = torch.tensor([t for _, t in frontier], device=emb.device)
            h = self.head.step(hid, emb[toks].to(self.dtype))
            top = self._top(h, branching).tolist()
            nxt, rows = [], []
            for i, ((node, _), cand) in enumerate(zip(frontier, top)):
                for tok in cand:
                    if len(tokens) >= max_nodes:
                        break
                    tokens.append(int(tok))
                    parents.append(node)
                    nxt.append((len(tokens) - 1, int(tok)))
                    rows.append(i)
            frontier, hid = nxt, h[rows]
        return DraftTree(tuple(tokens), tuple(parents))


def save_drafter(head: DraftHead, path: Path, meta: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(tmp / WEIGHTS))
    (tmp / META).write_text(json.dumps({**meta, "hidden": head.hidden}, indent=2))
    if path.exists():
        import shutil
        shutil.rmtree(path)
    tmp.rename(path)


def load_drafter(path: str | Path | None, target: K3ForCausalLM, dtype: torch.dtype = torch.float32,
                 fp8_weights: bool = False) -> TrainedDrafter:
    """The trained head at `path` (a `k3 train-drafter` output directory) for `target`, drafting in `dtype` (with
    `fp8_weights`, its matrices in e4m3: TrainedDrafter); errors name the field."""
    if path is None:
        raise ValueError("speculative.drafter_path: method 'drafter' needs the trained head's directory "
                         "(`k3 train-drafter` prints it)")
    p = Path(path)
    if not (p / WEIGHTS).exists() or not (p / META).exists():
        raise ValueError(f"speculative.drafter_path: no trained drafter at {p} (expected {WEIGHTS} and {META}; "
                         f"run `k3 train-drafter`)")
    meta = json.loads((p / META).read_text())
    if meta["hidden"] != target.config.hidden_size:
        raise ValueError(f"speculative.drafter_path: the drafter at {p} was trained for hidden size "
                         f"{meta['hidden']}, the target has {target.config.hidden_size}")
    vocab = meta.get("draft_vocab")   # drafters saved before the draft vocabulary score the whole head
    V = target.config.vocab_size
    if vocab is not None and (not vocab or len(set(vocab)) != len(vocab) or min(vocab) < 0 or max(vocab) >= V):
        raise ValueError(f"speculative.drafter_path: the drafter at {p} has a draft_vocab that is not distinct "
                         f"token ids in [0, {V})")
    with torch.device("meta"):   # no random init of weights that are loaded next (2.4 s at K3's width on the host)
        head = DraftHead(meta["hidden"])
    head.load_state_dict(load_file(str(p / WEIGHTS)), assign=True)
    dev = next(target.parameters()).device
    return TrainedDrafter(head.to(dev), target, vocab, dtype, fp8_weights)
