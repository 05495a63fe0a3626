"""A request as the scheduler tracks it, from arrival to its last token or error."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.scheduler.request_features import RequestFeatures
from engine.scheduler.adaptive import Region
from engine.scheduler.sampling import SamplingParams
from engine.cache.sequence import SequenceState
from telemetry import events as ev


@dataclass
class Request:
    """One client request and everything the loop needs to schedule it.

    ``chunk_offset`` is how far its prompt has been prefilled; ``last_token``
    is the token a decode step feeds back in.
    """

    request_id: int
    prompt_tokens: list[int]
    params: SamplingParams
    arrival_ns: int
    arrival_tick: int
    conversation_id: int | None = None
    features: RequestFeatures = field(default_factory=RequestFeatures)
    seq: SequenceState = field(init=False)
    generator: torch.Generator | None = field(init=False)
    status: str = ev.REQ_WAITING
    chunk_offset: int = 0
    output_tokens: list[int] = field(default_factory=list)
    last_token: int | None = None
    admitted_ns: int | None = None
    admitted_tick: int | None = None
    first_token_ns: int | None = None
    finished_ns: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    prefix_hit_tokens: int = 0
    prefix_miss_reason: str | None = None
    # Grammar-constrained requests are never preemption victims (reference rule, applied in
    # scheduler/preempt.py); set at submit when the request carries a grammar (grammar_step.attach).
    has_grammar: bool = False
    grammar_spec: Any = None          # engine.grammar.spec.GrammarSpec: what the output must obey
    grammar_future: Any = None        # the compile in flight (concurrent.futures.Future)
    grammar: Any = None               # engine.grammar.matcher.GrammarState once compiled
    grammar_ready_tick: int | None = None   # the tick it was seen compiled (a replay waits for it)
    grammar_valid: bool | None = None       # the ended output is a complete sentence of the grammar
    grammar_approximations: tuple[str, ...] = ()   # schema keywords its lenient compile ignored
    pending_drafts: list[int] = field(default_factory=list)
    # Left by the last speculative step for the next one (engine/scheduler/spec_step.py): the
    # cached-token count the drafts were proposed at (made on the secondary stream). Stale
    # once any other forward advances the sequence.
    pending_drafts_at: int | None = None
    region: Region = field(default_factory=Region)   # inside a code fence / tool call (adaptive sampling)
    sampling_record: dict | None = None               # the sampling as stored (built once: params never change)
    features_record: dict | None = None               # the features as stored (built once)
    first_token_rules: str | None = None              # which first-token rules fired (set at token 0)
    # With features.logprobs: per output token (its logprob, [(id, logprob)] of the top k).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # With features.prompt_logprobs: per prompt token from token 1 on, as ``logprobs``.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    stop_string: str | None = None                    # the stop string that ended the output, if any

    def __post_init__(self) -> None:
        self.seq = SequenceState(request_id=self.request_id)
        self.generator = None
        if self.params.seed is not None:
            # A per-request generator: draws depend on this request alone, so a
            # replay reproduces tokens whatever the batch around it looks like.
            self.generator = torch.Generator().manual_seed(int(self.params.seed))

    @property
    def prefix_key(self):
        """The prompt as the prefix cache keys it (``PromptImages.prefix_key`` with images)."""
        return self.seq.images.prefix_key if self.seq.images is not None else self.prompt_tokens

    @property
    def num_images(self) -> int:
        return len(self.seq.images.spans) if self.seq.images is not None else 0

    def clear_pending_drafts(self) -> None:
        """Forget the drafts of the last speculative step."""
        self.pending_drafts = []
        self.pending_drafts_at = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_generated(self) -> int:
        return len(self.output_tokens)

    @property
    def is_prefill_done(self) -> bool:
        return self.chunk_offset >= self.prompt_len

    def _sampling_dict(self) -> dict:
        if self.sampling_record is None:
            self.sampling_record = self.params.to_dict()
        return self.sampling_record

    def record(self, tick: int, t_ns: int) -> ev.RequestRecord:
        """The request's current row for the upserted ``requests`` table."""
        return ev.RequestRecord(
            tick=tick, t_ns=t_ns, request_id=self.request_id, status=self.status,
            arrival_ns=self.arrival_ns, admitted_ns=self.admitted_ns,
            first_token_ns=self.first_token_ns, finished_ns=self.finished_ns,
            arrival_tick=self.arrival_tick, prompt_len=self.prompt_len,
            output_len=self.num_generated, prefix_hit_tokens=self.prefix_hit_tokens,
            prefix_miss_reason=self.prefix_miss_reason, error=self.error,
            finish_reason=self.finish_reason, sampling=self._sampling_dict(),
            # The prompt never changes after submit, so the row shares it; the output grows,
            # so the row gets a copy (the writer encodes it later, on its own thread).
            prompt_tokens=self.prompt_tokens, output_tokens=list(self.output_tokens),
            conversation_id=self.conversation_id, source=self.features.source,
            features=self._features_dict(), first_token_rules=self.first_token_rules,
            grammar=self.grammar_spec.to_dict() if self.grammar_spec is not None else None,
            grammar_kind=self.grammar_spec.kind if self.grammar_spec is not None else None,
            grammar_ready_tick=self.grammar_ready_tick, grammar_valid=self.grammar_valid,
            grammar_approximations=",".join(self.grammar_approximations) or None,
            num_images=len(self.features.images),
        )

    def _features_dict(self) -> dict:
        if self.features_record is None:
            self.features_record = self.features.to_dict()
        return self.features_record
