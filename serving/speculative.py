"""Speculative decoding with GLM-5's MTP layer as the drafter, per sequence.

After each step the MTP layer runs over the step's rows (the main model's
hidden state at position t and token t+1, written to the MTP layer's own
pages at the same positions), and its prediction at the last computed
position becomes a greedy request's draft for the token after its last one.
The next step computes the last token and the draft together (a 2-token
chunk); where the main model's own greedy choice at the last token equals
the draft, the draft is accepted and the choice after it comes free: two
tokens from one forward. A rejected draft's cache slot is simply computed
again later. The output is the main model's greedy output whatever the
drafter proposes. Drafts are made for greedy requests only (sampled ones
would need rejection sampling), and not with prefix caching: the MTP entry
at a page's last position depends on the next page's first token, so a
cached page's MTP keys would not be a function of its own tokens.
"""
from __future__ import annotations

import torch


class MTPDrafter:
    num_speculative_tokens = 1          # GLM-5 has one MTP layer

    def __init__(self, model):
        if not len(model.model.mtp):
            raise ValueError("speculative=True needs a model with an MTP layer (num_nextn_predict_layers >= 1)")
        self.model = model
        self.proposed = [0] * self.num_speculative_tokens
        self.accepted = [0] * self.num_speculative_tokens
        self.verify_forwards = 0
        self.verified_tokens = 0

    def verify(self, req, logits: torch.Tensor) -> list[int]:
        """The tokens a request gets from its rows' logits [1 + drafts, V] (greedy):
        each draft that equals the main model's choice, then the choice after the last one kept."""
        choice = logits.argmax(-1).tolist()
        tokens = []
        for i, draft in enumerate(req.spec_token_ids):
            self.proposed[i] += 1
            if choice[i] != draft:
                break
            self.accepted[i] += 1
            tokens.append(draft)
        tokens.append(choice[len(tokens)])
        self.verify_forwards += 1
        self.verified_tokens += len(tokens)
        return tokens

    def draft(self, batch, hidden: torch.Tensor, wants_draft) -> None:
        """Runs the MTP layer over the step's rows and sets spec_token_ids of the
        requests wants_draft(req) accepts."""
        next_ids, rows_for = [], {}
        for chunk, lo in zip(batch.chunks, batch.offsets):
            req = chunk.request
            tokens = req.all_token_ids
            for p in range(chunk.start, chunk.start + chunk.num_tokens):
                # past the last computed position (a rejected draft's row) any id will do: recomputed later
                next_ids.append(tokens[p + 1] if p + 1 < len(tokens) else 0)
            last = req.num_tokens - 2               # the last computed position: it predicts the next token
            if chunk.start <= last < chunk.start + chunk.num_tokens and wants_draft(req):
                rows_for[req.request_id] = (req, lo + last - chunk.start)
        ids = torch.tensor([next_ids], dtype=torch.int64, device=hidden.device)
        h = self.model.packed_mtp_hidden(hidden, ids, batch.positions, batch.segments)
        if not rows_for:
            return
        reqs, rows = zip(*rows_for.values())
        drafts = self.model.mtp_head(h[0, list(rows)]).argmax(-1).tolist()
        for req, d in zip(reqs, drafts):
            req.spec_token_ids = [d]

    def stats(self) -> dict:
        return {"spec_acceptance_per_position": [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)],
                "spec_drafts_proposed": list(self.proposed),
                "spec_tokens_per_verify": self.verified_tokens / self.verify_forwards if self.verify_forwards else 0.0}
