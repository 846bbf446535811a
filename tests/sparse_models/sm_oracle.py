"""Brute-force oracle for podkit's model schemes: one sequence at a time, explicit attention masks.

Written independently of ``kernels`` and ``sparse_models.schemes``: every attention is a dense
[heads, queries, keys] logit matrix with an explicit boolean mask (and, for POD, an explicit choice
of key source per (query, key) pair). Norms, MLPs, RoPE and projections are the model's own modules.

``run_sequence`` simulates what a scheme does to one sequence: a prefill over ``prompt`` and then one
decode step per token of ``continuation`` (teacher forcing), and returns the logits of every step.
"""

from __future__ import annotations

import math

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


class Oracle:
    def __init__(self, model, sparse_config):
        self.lm = model
        self.base = model.model
        self.cfg = sparse_config
        c = model.config
        self.L = c.num_hidden_layers
        self.Hq = c.num_attention_heads
        self.Hkv = c.num_key_value_heads
        self.G = self.Hq // self.Hkv
        self.D = c.head_dim
        pod_used = sparse_config.prefill_scheme == "pod" or sparse_config.decode_scheme in ("pod", "pod+tidal")
        self.anchors = sparse_config.pod.anchor_map(self.L, self.Hkv) if pod_used else \
            [[l] * self.Hkv for l in range(self.L)]

    # --------------------------------------------------------------- helpers
    def _qkv(self, layer, h, positions):
        attn = self.base.layers[layer].self_attn
        x = self.base.layers[layer].input_layernorm(h)
        s = x.shape[0]
        q = attn.q_proj(x).view(s, self.Hq, self.D).transpose(0, 1)[None]
        k = attn.k_proj(x).view(s, self.Hkv, self.D).transpose(0, 1)[None]
        v = attn.v_proj(x).view(s, self.Hkv, self.D).transpose(0, 1)[None]
        cos, sin = self.base.rotary_emb(h[None], positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q[0].double(), k[0].double(), v[0].double()

    def _finish(self, layer, h, attn_out):
        attn = self.base.layers[layer].self_attn
        s = h.shape[0]
        h = h + attn.o_proj(attn_out.transpose(0, 1).reshape(s, -1).to(h.dtype))
        return h + self.base.layers[layer].mlp(self.base.layers[layer].post_attention_layernorm(h))

    def _proximal(self, i, j):
        pod = self.cfg.pod
        return j < pod.sink_tokens or i - j < pod.recent_window

    def _pod_logits(self, layer, qh, i, n, K, Q, q_vec):
        """Logits [n] of query position i under POD; v1 score sharing takes distant logits from the anchor."""
        scale = self.D ** -0.5
        if self.cfg.pod.sharing != "scores":
            return q_vec @ self._pod_keys(layer, qh, i, n, K).T * scale
        g = qh // self.G
        a = self.anchors[layer][g]
        vals = [q_vec @ K[layer][g][j] if (a == layer or self._proximal(i, j)) else Q[a][qh, i] @ K[a][g][j]
                for j in range(n)]
        return torch.stack(vals) * scale

    def _pod_keys(self, layer, qh, i, n, K):
        """keys [n, D] for query position i of layer/query head qh under POD (own if proximal)."""
        g = qh // self.G
        a = self.anchors[layer][g]
        own, anchor = K[layer][g], K[a][g]
        rows = [own[j] if (a == layer or self._proximal(i, j)) else anchor[j] for j in range(n)]
        return torch.stack(rows)

    @staticmethod
    def _softmax_attend(logits, allowed, v):
        logits = logits.masked_fill(~allowed, float("-inf"))
        if not bool(allowed.any()):
            return torch.zeros(v.shape[-1], dtype=v.dtype)
        p = torch.softmax(logits, -1)
        return p @ v

    # --------------------------------------------------------------- prefill
    def prefill(self, tokens):
        n = len(tokens)
        h = self.base.embed_tokens(torch.tensor(tokens))
        pos = torch.arange(n)
        K, V, Q = [], [], []
        self.Q = Q
        scheme = self.cfg.prefill_scheme
        ts_layers = set(self.cfg.token_sparse.sparse_layers or range(self.L // 2, self.L))
        for layer in range(self.L):
            q, k, v = self._qkv(layer, h, pos)
            K.append(k)
            V.append(v)
            Q.append(q)
            out = torch.zeros(self.Hq, n, self.D, dtype=torch.float64)
            scale = self.D ** -0.5
            kept = None
            if scheme == "token_sparse" and layer in ts_layers:
                kept = self._token_sparse_keep(q, k, n)
            for qh in range(self.Hq):
                g = qh // self.G
                for i in range(n):
                    if scheme == "pod":
                        logits = self._pod_logits(layer, qh, i, n, K, Q, q[qh, i])
                    else:
                        logits = q[qh, i] @ k[g].T * scale
                    allowed = torch.arange(n) <= i
                    if kept is not None:
                        if i not in kept[qh]:
                            continue  # dropped query: zero output
                        allowed = allowed & torch.tensor([j in kept[qh] for j in range(n)])
                    out[qh, i] = self._softmax_attend(logits, allowed, v[g])
            h = self._finish(layer, h, out)
        self.K, self.V = K, V
        self.n = n
        h = self.base.norm(h)
        return self.lm.lm_head(h)

    def _token_sparse_keep(self, q, k, n):
        ts = self.cfg.token_sparse
        w = ts.window
        if ts.coverage == 0 or n <= ts.min_tokens + w:
            return [set(range(n)) for _ in range(self.Hq)]
        prefix = n - w
        scale = self.D ** -0.5
        scores = torch.zeros(self.Hq, n, dtype=torch.float64)
        for qh in range(self.Hq):
            g = qh // self.G
            for i in range(prefix, n):
                logits = q[qh, i] @ k[g, : i + 1].T * scale
                scores[qh, : i + 1] += torch.softmax(logits, -1) / w
        scores[:, prefix:] = 0
        half = ts.pool_kernel // 2
        pooled = torch.zeros_like(scores)
        for t in range(prefix):
            lo, hi = max(0, t - half), min(n, t + half + 1)
            pooled[:, t] = scores[:, lo:hi].sum(-1) / ts.pool_kernel
        mean = pooled[:, :prefix].mean(0)
        mean = mean / mean.sum()
        cum = torch.cumsum(torch.sort(mean).values, 0)
        k_sparse = int((cum < ts.coverage).sum()) + 1
        k_keep = min(prefix, max(ts.min_tokens, prefix - k_sparse))
        keep = []
        for qh in range(self.Hq):
            order = sorted(range(prefix), key=lambda t: -float(pooled[qh, t]))
            keep.append(set(order[:k_keep]) | set(range(prefix, n)))
        return keep

    # --------------------------------------------------------------- decode
    def decode(self, token):
        p = self.n  # new position
        n = p + 1
        h = self.base.embed_tokens(torch.tensor([token]))
        scheme = self.cfg.decode_scheme
        scale = self.D ** -0.5
        selected = {}
        plan = self.lm.plan  # only the role names are read (the plan's own tests check build_plan)
        for layer in range(self.L):
            q, k, v = self._qkv(layer, h, torch.tensor([p]))
            self.K[layer] = torch.cat([self.K[layer], k], 1)
            self.V[layer] = torch.cat([self.V[layer], v], 1)
            self.Q[layer] = torch.cat([self.Q[layer], q], 1)
            K, V = self.K, self.V
            out = torch.zeros(self.Hq, 1, self.D, dtype=torch.float64)
            role = plan[layer].decode
            if role == "quest":
                bounds = [self._page_bounds(K[layer][g], n) for g in range(self.Hkv)]
            for qh in range(self.Hq):
                g = qh // self.G
                pod_keys = scheme in ("pod", "pod+tidal")
                if pod_keys:
                    logits = self._pod_logits(layer, qh, p, n, K, self.Q, q[qh, 0])
                else:
                    logits = q[qh, 0] @ K[layer][g].T * scale
                allowed = torch.ones(n, dtype=torch.bool)
                if role in ("full+select",):
                    selected.setdefault(layer, {})[qh] = logits
                elif role == "sparse-over-selected":
                    allowed = self._tidal_allowed(selected[plan[layer].selection_source], qh, n)
                elif role == "quest":
                    allowed = self._quest_allowed(q[qh, 0], bounds[g], n)
                elif role == "streaming":
                    st = self.cfg.streaming
                    allowed = torch.tensor([j < st.sink_tokens or j > p - st.recent_window for j in range(n)])
                if role == "pod-shared" and self.cfg.pod.gate_tau is not None:
                    allowed = self._gate_allowed(layer, qh, logits, p, n)
                out[qh, 0] = self._softmax_attend(logits, allowed, V[layer][g])
                if role in ("pod-anchor", "pod-shared") and self.cfg.pod.gate_tau is not None:
                    self._gates.setdefault(layer, {})[qh] = self._gate(logits, p, n)
            h = self._finish(layer, h, out)
        self.n = n
        return self.lm.lm_head(self.base.norm(h))

    _gates: dict = {}

    def _gate(self, logits, p, n):
        prox = torch.tensor([self._proximal(p, j) for j in range(n)])
        return float(torch.exp(torch.logsumexp(logits[prox], 0) - torch.logsumexp(logits, 0)))

    def _gate_allowed(self, layer, qh, logits, p, n):
        pod = self.cfg.pod
        g = qh // self.G
        a = self.anchors[layer][g]
        if a == layer:
            return torch.ones(n, dtype=torch.bool)
        exact = pod.gate_estimate == "exact" or pod.sharing == "scores"  # v1: the exact gate is cheap
        gate = self._gate(logits, p, n) if exact else self._gates[a][qh]
        if gate >= pod.gate_tau:
            return torch.tensor([self._proximal(p, j) for j in range(n)])
        return torch.ones(n, dtype=torch.bool)

    def _tidal_allowed(self, logits_by_head, qh, n):
        budget = self.cfg.tidal.budget
        if self.cfg.tidal.selection == "kv_group":
            g = qh // self.G
            probs = sum(torch.softmax(logits_by_head[h], -1) for h in range(g * self.G, (g + 1) * self.G))
            score = probs[: n - 1]
        else:
            score = logits_by_head[qh][: n - 1]
        allowed = torch.zeros(n, dtype=torch.bool)
        allowed[n - 1] = True
        order = sorted(range(n - 1), key=lambda j: -float(score[j]))
        for j in order[: budget - 1]:
            allowed[j] = True
        return allowed

    def _page_bounds(self, keys, n):
        """Per page (max, min) over its tokens' keys, channel by channel."""
        ps = self.cfg.quest.page_size
        rows = keys.tolist()
        bounds = []
        for pg in range(math.ceil(n / ps)):
            page = rows[pg * ps: min(n, (pg + 1) * ps)]
            cols = list(zip(*page))
            bounds.append((torch.tensor([max(c) for c in cols], dtype=torch.float64),
                           torch.tensor([min(c) for c in cols], dtype=torch.float64)))
        return bounds

    def _quest_allowed(self, q, bounds, n):
        qc = self.cfg.quest
        ps = qc.page_size
        pages = math.ceil(n / ps)
        current = pages - 1
        scores = []
        for mx, mn in bounds:
            scores.append(float(torch.maximum(q * mx, q * mn).sum()))
        scores[current] = float("inf")
        chosen = sorted(range(pages), key=lambda pg: -scores[pg])[: max(1, qc.budget // ps)]
        allowed = torch.zeros(n, dtype=torch.bool)
        for pg in chosen:
            allowed[pg * ps: min(n, (pg + 1) * ps)] = True
        return allowed

    # --------------------------------------------------------------- whole sequences
    @torch.no_grad()
    def run_sequence(self, prompt, continuation):
        """Logits of the prompt ([n, V]) and of each decode step ([V] each)."""
        self._gates = {}
        prompt_logits = self.prefill(prompt)
        steps = []
        for i, token in enumerate(continuation):
            if self._correction_due(i):
                self._correct(prompt, continuation[:i])
            steps.append(self.decode(token)[0])
        return prompt_logits, steps

    def _correction_due(self, i):
        t = self.cfg.tidal.correction_period
        return self.cfg.decode_scheme in ("tidal", "pod+tidal") and t is not None and i > 0 and i % t == 0

    def _correct(self, prompt, decoded):
        """TidalDecode correction: the K/V of every token so far as a dense (exact) forward gives them."""
        tokens = list(prompt) + list(decoded)
        n = len(tokens)
        h = self.base.embed_tokens(torch.tensor(tokens))
        pos = torch.arange(n)
        pod = self.cfg.decode_scheme == "pod+tidal"
        K, V = [], []
        scale = self.D ** -0.5
        for layer in range(self.L):
            q, k, v = self._qkv(layer, h, pos)
            K.append(k)
            V.append(v)
            out = torch.zeros(self.Hq, n, self.D, dtype=torch.float64)
            for qh in range(self.Hq):
                for i in range(n):
                    keys = self._pod_keys(layer, qh, i, n, K) if pod else k[qh // self.G]
                    out[qh, i] = self._softmax_attend(q[qh, i] @ keys.T * scale, torch.arange(n) <= i, v[qh // self.G])
            h = self._finish(layer, h, out)
        # only the decoded tokens' K/V are rewritten; the prompt's came from the (possibly sparse) prefill
        start = len(prompt)
        for layer in range(self.L):
            self.K[layer][:, start:n] = K[layer][:, start:n]
            self.V[layer][:, start:n] = V[layer][:, start:n]
