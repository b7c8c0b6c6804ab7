"""Baseline against speculative decoding: same prompts, same token budget, every run audited.

For each repeat and each prompt, the target-only baseline runs first and every
speculative configuration right after it, so that each speed-up is a ratio of
two runs measured side by side. Each run becomes one JSONL record holding its
raw numbers (tokens, timings, counters, passes, memory, the machine) and its
audit verdict; tables and plots are derived from those records alone.
"""

from __future__ import annotations

import hashlib
import json
import re
import resource
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from verispec.errors import VerispecError
from verispec.generate import encode_prompt, generate, make_proposer
from verispec.lab.audit import (DEFAULT_SLACK, INVALID, VALID, Verdict, check_output, check_sampled_output,
                                check_structure, logit_margin, run_checks, sampled_evidence, worst)
from verispec.lab.prompts import Prompt
from verispec.lab.calibrate import machine_facts
from verispec.sampling import SamplingParams
from verispec.spec.draft_model import pair_vocab_limit
from verispec.structured import Structure, StructureError, StructureState, asked_structure, structure_of

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ProposerSpec:
    """What drafts: nothing (the baseline), prompt lookup, synthetic acceptance α, or a draft model."""
    label: str
    kind: str  # "baseline" | "ngram" | "synthetic" | "draft"
    alpha: float | None = None


BASELINE = ProposerSpec("baseline", "baseline")


def parse_proposer(text: str) -> ProposerSpec:
    """'ngram', 'synthetic:α' (0 <= α <= 1), 'baseline', or a draft model name or path."""
    text = str(text).strip()
    if text in ("baseline", "none"):
        return BASELINE
    if text == "ngram":
        return ProposerSpec("ngram", "ngram")
    if text.startswith("synthetic:"):
        try:
            alpha = float(text.split(":", 1)[1])
        except ValueError:
            alpha = -1.0
        if not 0 <= alpha <= 1:
            raise VerispecError(f"{text!r}: synthetic acceptance takes a probability, e.g. synthetic:0.8")
        return ProposerSpec(f"synthetic:{alpha:g}", "synthetic", alpha)
    return ProposerSpec(text, "draft")


@dataclass(frozen=True)
class RunConfig:
    proposer: ProposerSpec
    gamma: int = 0
    adaptive: bool | str = False
    lookup: bool = True  # with the cost-aware schedule, a draft model's rounds may send prompt lookup's drafts
    # a draft model proposes only the first ids and the context's: a number, None (all) or "auto"
    # (draft_vocab_limit; records hold the number it gives)
    draft_vocab: int | str | None = None

    @property
    def lookup_applies(self) -> bool:
        """Only the cost-aware schedule with a draft model weighs prompt lookup's drafts."""
        return self.adaptive == "cost" and self.proposer.kind == "draft"

    @property
    def label(self) -> str:
        if self.proposer.kind == "baseline":
            return "baseline"
        schedule = f" adaptive={self.adaptive}" if self.adaptive else ""
        if self.lookup_applies and not self.lookup:
            schedule += " no-lookup"
        if self.draft_vocab is not None:
            schedule += f" vocab={self.draft_vocab}"
        return f"{self.proposer.label} γ={self.gamma}{schedule}"


BASELINE_RUN = RunConfig(BASELINE)


@dataclass
class BenchSettings:
    max_tokens: int = 64
    repeats: int = 1
    temperature: float = 0.0  # greedy by default; sampled output is checked against the target's distribution
    seed: int = 0
    chat: bool | None = None  # None: wrap prompts in the chat template when the model has one
    ignore_eos: bool = False
    warmup: bool = True
    bandwidth_gb_s: float | None = None  # the machine's peak; enables the bandwidth rule
    slack: float = DEFAULT_SLACK
    ngram: tuple[int, int] = (3, 1)
    # every output held to a JSON schema (True: any JSON object), a regular expression or a
    # grammar (Lark in llguidance's dialect), one at most
    json_schema: dict | bool | None = None
    regex: str | None = None
    grammar: str | None = None

    def structure(self) -> Structure | None:
        """The structure the outputs are held to, compiled once to refuse a bad one before any run."""
        structure = structure_of(self.json_schema, self.regex, self.grammar)
        if structure is not None and self.ignore_eos:
            raise StructureError("a structured output ends where its structure does: leave out ignore_eos")
        return structure

    def structure_key(self) -> str | None:
        """What names the structure in run keys and records: a hash of the schema, pattern or grammar."""
        asked = asked_structure(self.json_schema, self.regex, self.grammar)
        if asked is None:
            return None
        kind, value = asked
        digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]
        return f"{kind}:{digest}"


def load_for_bench(spec: str, weights: str | None = None, device: str = "cpu", kv_cache: str | None = None):
    """Load a model in the given weight format (float32 activations unless the format is a float type)."""
    from verispec.loading import load_model

    dtype = weights if weights in ("float32", "bfloat16", "float16") else "float32"
    return load_model(spec, dtype, device, weights, kv_cache)


def bytes_read_per_pass(target) -> int:
    """A lower bound on the weight bytes one target pass reads.

    A dense model reads every weight. A mixture of experts reads at least the
    top-k experts' share of its expert weights (a pass over several positions
    reads more, which only makes this bound safer). A hybrid model also reads
    its recurrent state once per pass.
    """
    total = target.weight_bytes()
    state_bytes = getattr(target.model, "state_bytes", None)
    if callable(state_bytes):
        total += int(state_bytes())
    config = target.config
    if not config.is_moe or not config.num_experts_per_tok:
        return total
    expert_bytes = sum(t.numel() * t.element_size()
                       for name, t in [*target.model.named_parameters(), *target.model.named_buffers()]
                       if re.search(r"\.experts(\.|$)", name))
    unread = expert_bytes * (1 - config.num_experts_per_tok / config.num_experts)
    return int(total - unread)


def run_key(target: str, weights: str, prompt_set: str, prompt_id: str, config: RunConfig, repeat: int,
            settings: BenchSettings, draft_weights: str | None = None) -> str:
    """Identifies one run across restarts of a sweep. A draft model's run names the draft's
    weight format too: the same draft in another format is another measurement."""
    label = f"{config.label} draft={draft_weights}" if config.proposer.kind == "draft" else config.label
    parts = [target, weights, prompt_set, prompt_id, label, repeat, settings.max_tokens, settings.temperature]
    structure = settings.structure_key()
    if structure:  # held outputs are other runs (keys of free ones stay as they were)
        parts.append(structure)
    return "|".join(map(str, parts))


def plan_runs(prompts: list[Prompt], configs: list[RunConfig], repeats: int) -> list[tuple[Prompt, RunConfig, int]]:
    """Every run in order: per repeat and prompt, the baseline, then each speculative configuration
    right after it, so that each speed-up compares two runs measured side by side."""
    configs = [c for c in configs if c.proposer.kind != "baseline"]
    return [(prompt, config, repeat)
            for repeat in range(repeats)
            for prompt in prompts
            for config in [BASELINE_RUN, *configs]]


class PassCounter:
    """Counts the target's forward passes: those on the cache of the first pass (the prefill).

    A draft model that is the very same module runs on its own cache, so its passes are not counted.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.passes = 0
        self.cache = None

    def _hook(self, module, args) -> None:
        cache = args[1] if len(args) > 1 else None
        if self.cache is None:
            self.cache = cache
        if cache is self.cache:
            self.passes += 1

    def __enter__(self) -> "PassCounter":
        self.handle = self.model.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def peak_rss_mb() -> float:
    """The process's peak resident memory so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


class Bench:
    """Runs baseline and speculative configurations of one loaded target over prompt sets.

    `done` maps run keys to records of earlier runs, which are reused rather than run
    again (a resumed sweep); every new record goes to `on_record`, and `on_run` hears
    which run starts next.
    """

    def __init__(self, target, settings: BenchSettings, drafts: Mapping[str, object] | None = None,
                 on_record: Callable[[dict], None] | None = None, done: Mapping[str, dict] | None = None,
                 on_run: Callable[[str], None] | None = None, label: str | None = None):
        self.target = target
        self.label = label or target.name  # how records name the target
        self.settings = settings
        self.drafts = dict(drafts or {})
        self.on_record = on_record or (lambda record: None)
        self.on_run = on_run or (lambda label: None)
        self.records = dict(done or {})
        self.machine = machine_facts(str(target.device))
        self.model_bytes = bytes_read_per_pass(target)
        self.structure = settings.structure()
        self._draft_proposers: dict[tuple[str, int | None], object] = {}
        self._warm = not settings.warmup

    def key(self, prompt_set: str, prompt: Prompt, config: RunConfig, repeat: int) -> str:
        weights = self.target.weights
        if self.target.model.cache_dtype is not None:  # a cache type asked for gives other runs
            weights += f"/kv-{self.target.kv_cache}"
        return run_key(self.label, weights, prompt_set, prompt.id, config, repeat, self.settings,
                       self.draft_weights(config))

    def prompt_set_label(self, prompt_set: str) -> str:
        """How records name the prompt set: held to a structure it is another workload, whose
        runs the report keeps apart (baselines included) from the same prompts' free runs."""
        structure = self.settings.structure_key()
        return f"{prompt_set} [{structure}]" if structure else prompt_set

    def draft_weights(self, config: RunConfig) -> str | None:
        """The weight format of the run's draft model; None for other proposers."""
        draft = self.drafts.get(config.proposer.label) if config.proposer.kind == "draft" else None
        return draft.weights if draft is not None else None

    def run(self, prompt_set: str, prompts: list[Prompt], configs: list[RunConfig]) -> list[dict]:
        """Run (or reuse) every run of the plan; returns their records in plan order."""
        configs = [c for c in configs if c.proposer.kind != "baseline"]
        encoded = {p.id: self.encode(p) for p in prompts}
        out = []
        for prompt, config, repeat in plan_runs(prompts, configs, self.settings.repeats):
            key = self.key(prompt_set, prompt, config, repeat)
            if key in self.records:
                out.append(self.records[key])
                continue
            if not self._warm:
                self.warm_up(prompts[0], encoded[prompts[0].id], configs)
            baselines = [self.records[k] for k in (self.key(prompt_set, prompt, BASELINE_RUN, r)
                                                   for r in range(repeat + 1)) if k in self.records]
            self.on_run(f"{prompt_set} #{prompt.id} {config.label} (repeat {repeat + 1})")
            record = self.measure(key, prompt_set, prompt, encoded[prompt.id], config, repeat, baselines)
            self.records[key] = record
            self.on_record(record)
            out.append(record)
        return out

    def draft_vocab(self, config: RunConfig) -> int | None:
        """The first ids the run's draft model proposes (with the context's), None for all of
        them: how records name the draft vocabulary, whichever way the configuration chose it."""
        draft = self.drafts.get(config.proposer.label) if config.proposer.kind == "draft" else None
        return None if draft is None else pair_vocab_limit(config.draft_vocab, draft, self.target)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's ids: in the chat template when asked for (by default, when the model has
        one), or the fill-in-the-middle prompt of a prompt with a suffix (never a chat)."""
        tokenizer = self.target.tokenizer
        chat = self.settings.chat if self.settings.chat is not None else bool(tokenizer.chat_template)
        return encode_prompt(tokenizer, prompt.text, chat and prompt.suffix is None, prompt.suffix)

    def warm_up(self, prompt: Prompt, prompt_ids: list[int], configs: list[RunConfig]) -> None:
        """One short unrecorded run per proposer (and draft vocabulary): first calls allocate and
        pick kernels (and a structure's first matcher reads the tokenizer)."""
        tokens = min(WARMUP_TOKENS, self.settings.max_tokens)
        reference = self.generate(prompt, prompt_ids, BASELINE_RUN, None, tokens)[0].token_ids
        seen = set()
        for config in configs:
            if (config.proposer.label, config.draft_vocab) not in seen:
                seen.add((config.proposer.label, config.draft_vocab))
                self.generate(prompt, prompt_ids, config, reference, tokens)
        self._warm = True

    def proposer(self, config: RunConfig, reference: list[int] | None, repeat: int = 0):
        spec = config.proposer
        if spec.kind == "baseline":
            return None
        if spec.kind == "ngram":
            from verispec.spec.prompt_lookup import PromptLookupProposer
            return PromptLookupProposer(*self.settings.ngram)
        if spec.kind == "synthetic":
            from verispec.spec.synthetic import SyntheticProposer
            return SyntheticProposer(list(reference or []), spec.alpha, self.target.config.vocab_size,
                                     seed=self.settings.seed + repeat)
        key = (spec.label, config.draft_vocab)
        if key not in self._draft_proposers:  # tokenizers are compared once, not per run
            if spec.label not in self.drafts:
                raise VerispecError(f"draft model {spec.label!r} was not loaded")
            self._draft_proposers[key] = make_proposer(self.drafts[spec.label], self.target,
                                                       draft_vocab=config.draft_vocab)
        return self._draft_proposers[key]

    def generate(self, prompt: Prompt, prompt_ids: list[int], config: RunConfig, reference: list[int] | None,
                 max_tokens: int, repeat: int = 0):
        """(result, target passes) of one generation. A prompt with a suffix goes as its text, so
        that the tokens which end a middle end it."""
        s = self.settings
        source = prompt_ids if prompt.suffix is None else prompt.text
        with PassCounter(self.target.model) as counter:
            result = generate(self.target, source, suffix=prompt.suffix,
                              draft=self.proposer(config, reference, repeat),
                              gamma=config.gamma, adaptive=config.adaptive, max_tokens=max_tokens,
                              temperature=s.temperature, seed=s.seed + repeat, ignore_eos=s.ignore_eos,
                              ngram=s.ngram, lookup=config.lookup, json_schema=s.json_schema, regex=s.regex,
                              grammar=s.grammar)
        return result, counter.passes

    def measure(self, key: str, prompt_set: str, prompt: Prompt, prompt_ids: list[int], config: RunConfig,
                repeat: int, baselines: list[dict]) -> dict:
        """One run, recorded and audited. `baselines`: this prompt's baseline runs so far, by repeat."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        is_baseline = config.proposer.kind == "baseline"
        same_repeat = baselines[repeat] if len(baselines) > repeat else None
        reference = None if is_baseline else same_repeat["token_ids"]
        started = time.time()
        result, passes = self.generate(prompt, prompt_ids, config, reference, self.settings.max_tokens, repeat)
        record = self._record(key, prompt_set, prompt, config, repeat, result, passes, started)
        baseline_tok_s = None
        if not is_baseline:
            # against the median of this prompt's baselines so far: one slow baseline skews no ratio
            baseline_tok_s = statistics.median(b["tok_s"] for b in baselines)
            record["baseline_tok_s"] = baseline_tok_s
            record["speedup"] = record["tok_s"] / baseline_tok_s if baseline_tok_s else None
        if self.settings.temperature > 0:
            # sampled runs, the baseline's too (a control on the check), against the target's distribution
            evidence = self.sampled_evidence(key, config, prompt_ids, result.token_ids)
            output, record["sampled"] = check_sampled_output(evidence), evidence.to_dict()
        elif is_baseline:
            output = self.check_baseline(baselines[0] if baselines else None, result.token_ids)
        else:
            output = self.check_output(prompt_ids, same_repeat["token_ids"], result.token_ids)
        if self.structure is not None:
            output = worst([output, self.check_structure(result)])
        checks = run_checks(record, baseline_tok_s, output, self.settings.slack)
        record["audit"] = {**worst(checks.values()).to_dict(), **{k: v.to_dict() for k, v in checks.items()}}
        return record

    def sampled_evidence(self, key: str, config: RunConfig, prompt_ids: list[int], got: list[int]):
        """What the target's distribution says of a sampled output (audit.sampled_evidence), with the
        run's draft model as the alternative it may lean towards. The run's record keeps it, so
        that a configuration's runs are tested together as well."""
        params = SamplingParams(temperature=self.settings.temperature)
        kind = config.proposer.kind
        draft = self.drafts.get(config.proposer.label) if kind == "draft" else None
        if kind == "ngram":
            draft = self.proposer(config, None)  # a fresh lookup, as the run's
        return sampled_evidence(self.target, prompt_ids, got, params, zlib.crc32(key.encode()), draft,
                                self.allowed(got, len(got)))

    def check_output(self, prompt_ids: list[int], expected: list[int], got: list[int]) -> Verdict:
        """A tie is judged among the ids the structure allows there, if any: the choice was made among them."""
        def margin_at(at: int) -> tuple[float, float]:
            allowed = None if self.structure is None else self._matcher().allowed(before=expected[:at])[0]
            return logit_margin(self.target, prompt_ids, expected[:at], allowed)
        return check_output(expected, got, margin_at)

    def allowed(self, tokens: list[int], rows: int):
        """[rows, vocab] booleans, row i the ids the structure allows after tokens[:i]; None
        when the outputs are free."""
        return None if self.structure is None else self._matcher().allowed(tokens, rows=rows)

    def _matcher(self) -> StructureState:
        """A fresh matcher of the outputs' structure, at the start of an output."""
        return StructureState(self.structure, self.target.tokenizer, self.target.config.vocab_size)

    def check_structure(self, result) -> Verdict:
        """The output kept to its structure, and ended, if it did, where the structure may."""
        tokens = result.token_ids
        return check_structure(tokens, self.allowed(tokens, len(tokens) + 1), result.finish_reason == "eos",
                               self.target.tokenizer.eos_ids, self.structure.description)

    def check_baseline(self, first: dict | None, got: list[int]) -> Verdict:
        """Greedy decoding is deterministic: every repeat of a baseline must give the first one's tokens."""
        if first is None:
            return Verdict(VALID, "")
        if first["token_ids"] != got:
            return Verdict(INVALID, "the greedy baseline is not deterministic: this repeat differs from the first")
        return Verdict(VALID, "")

    def _record(self, key: str, prompt_set: str, prompt: Prompt, config: RunConfig, repeat: int, result,
                passes: int, started: float) -> dict:
        t = result.timings
        spec = result.spec.to_dict() if result.spec is not None else None
        if spec:
            split = {"draft_s": spec["draft_s"], "target_s": spec["verify_s"],
                     "other_s": max(0.0, t.decode_s - spec["draft_s"] - spec["verify_s"])}
        else:
            split = {"draft_s": 0.0, "target_s": t.decode_s, "other_s": 0.0}
        cuda_peak = (torch.cuda.max_memory_allocated() / 2**20) if self.target.device.type == "cuda" else None
        return {
            "key": key,
            "target": self.label,
            "weights": self.target.weights,
            "dtype": str(self.target.dtype).removeprefix("torch."),
            "kv_cache": self.target.kv_cache,
            "prompt_set": self.prompt_set_label(prompt_set),
            "prompt_id": prompt.id,
            "category": prompt.category,
            "proposer": config.proposer.label,
            "proposer_kind": config.proposer.kind,
            "draft_weights": self.draft_weights(config),
            "alpha": config.proposer.alpha,
            "gamma": config.gamma,
            "adaptive": config.adaptive,
            "lookup": config.lookup if config.lookup_applies else None,
            "draft_vocab": self.draft_vocab(config),
            "repeat": repeat,
            "max_tokens": self.settings.max_tokens,
            "temperature": self.settings.temperature,
            "structure": self.settings.structure_key(),
            "infill": prompt.suffix is not None,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.token_ids),
            "finish_reason": result.finish_reason,
            "token_ids": result.token_ids,
            "origins": result.origins,
            "tok_s": t.tokens_per_s,
            "prefill_s": t.prefill_s,
            "decode_s": t.decode_s,
            "time_split": split,
            "target_passes": passes,
            "spec": spec,
            "baseline_tok_s": None,
            "speedup": None,
            "model_bytes": self.model_bytes,
            "bandwidth_gb_s": self.settings.bandwidth_gb_s,
            "peak_rss_mb": peak_rss_mb(),
            "peak_cuda_mb": cuda_peak,
            "machine": self.machine,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        }


def spec_configs(proposers: list[str], gammas: list[int], adaptive: list[bool | str] | None = None,
                 lookup: list[bool] | None = None, draft_vocab: list[int | str | None] | None = None
                 ) -> list[RunConfig]:
    """The grid of speculative configurations: proposers × γ × schedules × `lookup` (whether the
    cost-aware schedule may send prompt lookup's drafts in a draft model's place) × `draft_vocab`
    (a draft model's vocabulary: None for all of it, "auto" by default); a configuration a
    choice means nothing to is made once."""
    configs = []
    for text in proposers:
        spec = parse_proposer(text)
        if spec.kind == "baseline":
            continue
        for gamma in gammas:
            for schedule in adaptive or [False]:
                weighs = RunConfig(spec, gamma, schedule).lookup_applies
                choices = dict.fromkeys(lookup or [True]) if weighs else [True]
                vocabularies = dict.fromkeys(draft_vocab or ["auto"]) if spec.kind == "draft" else [None]
                configs.extend(RunConfig(spec, gamma, schedule, choice, vocabulary)
                               for choice in choices for vocabulary in vocabularies)
    return configs
