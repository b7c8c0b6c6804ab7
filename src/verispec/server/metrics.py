"""Prometheus metrics, named as vLLM names them (with the `verispec:` prefix).

A dashboard built for vLLM's speculative decoding carries over by swapping the
prefix: drafts, draft tokens, accepted tokens and accepted tokens per draft
position. Since γ can change from round to round here (--adaptive), the draft
tokens per position are counted too, so that per-position acceptance is
accepted_per_pos / draft_tokens_per_pos exactly.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import choose_encoder

from verispec.events import GenerationResult

FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    def __init__(self, model_name: str, positions: int = 0):
        # the *_created series only double the output; vLLM drops them too
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        self.model_name = model_name
        counter = self._factory(Counter)
        gauge = self._factory(Gauge)
        self.requests = counter("request_success", "Requests finished, by finish reason.", "finished_reason")
        # read once per choice, as each choice prefills its prompt anew (the usage counts a prompt once)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens read, once per choice.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.running = gauge("num_requests_running", "Requests being decoded (at most one).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for the model.")
        self.target_passes = counter("spec_decode_num_target_passes",
                                     "Target forward passes of speculative requests, prefill included.")
        self.drafts = counter("spec_decode_num_drafts", "Rounds that drafted at least one token.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Drafted tokens the target kept.")
        self.accepted_per_position = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Drafted tokens kept, by position in the draft (0 first).", "position")
        self.drafted_per_position = counter("spec_decode_num_draft_tokens_per_pos",
                                            "Tokens drafted, by position in the draft (0 first).", "position")
        for reason in FINISH_REASONS:  # zero series exist before the first request
            self.requests.labels(self.model_name, reason)
        for position in range(positions):
            self.accepted_per_position.labels(self.model_name, str(position))
            self.drafted_per_position.labels(self.model_name, str(position))

    def _factory(self, kind):
        def make(name: str, documentation: str, *labels: str):
            metric = kind(f"verispec:{name}", documentation, ["model_name", *labels], registry=self.registry)
            return metric if labels else metric.labels(self.model_name)
        return make

    def record(self, result: GenerationResult, finish_reason: str) -> None:
        """Book one finished request."""
        self.requests.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        spec = result.spec
        if spec is None:
            return
        self.target_passes.inc(spec.rounds)
        self.drafts.inc(sum(1 for gamma in spec.gammas if gamma > 0))
        self.draft_tokens.inc(spec.drafted)
        self.accepted_tokens.inc(spec.accepted)
        for position, (accepted, drafted) in enumerate(zip(spec.accepted_by_position, spec.drafted_by_position)):
            self.accepted_per_position.labels(self.model_name, str(position)).inc(accepted)
            self.drafted_per_position.labels(self.model_name, str(position)).inc(drafted)

    def record_abort(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Book a request whose client left before the end (its speculative statistics are lost)."""
        self.requests.labels(self.model_name, "abort").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """The metrics in the text format a scraper's Accept header asks for, and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type
