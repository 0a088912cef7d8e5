"""Finish conditions after each sampled token: stop token ids / EOS, stop strings, max_new_tokens,
context."""

from __future__ import annotations

from sparkrelay.scheduler.request import Request


class StopChecker:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, req: Request, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def update(self, req: Request, context_length: int) -> None:
        """Refresh `req.output_text` and finish the request if a stop condition holds."""
        p, last = req.params, req.output_ids[-1]
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
        if last in stop_ids:
            req.output_text = self.decode(
                req, req.output_ids if p.no_stop_trim else req.output_ids[:-1]
            )
            req.finish({"type": "stop", "matched": last})
            return
        previous = len(req.output_text)
        req.output_text = self.decode(req, req.output_ids)
        if p.stop and self._match_stop_string(req, previous):
            return
        if len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= context_length:
            req.finish({"type": "length", "length": len(req.output_ids)})

    def _match_stop_string(self, req: Request, previous: int) -> bool:
        text = req.output_text
        hits = []
        for s in req.params.stop:
            # a new match must end in the newly decoded part of the text
            at = text.find(s, max(0, previous - len(s) + 1))
            if at >= 0:
                hits.append((at, s))
        if not hits:
            return False
        at, s = min(hits)
        req.output_text = text[: at + len(s)] if req.params.no_stop_trim else text[:at]
        req.finish({"type": "stop", "matched": s})
        return True
