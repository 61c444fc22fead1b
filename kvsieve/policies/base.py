"""The contract every eviction policy implements.

A policy decides, independently for every (batch row, KV head) of one layer, which cached tokens to keep. The
engine owns the storage (slots) and calls the policy at each forward step of that layer:

1. ``observe(slots, obs)`` — an :class:`Observation` of the step's queries over the slots (the model's attention
   probabilities with the query heads of a GQA group summed, the scaled logits per query head, the mask), possibly
   in several blocks of query rows. Policies accumulate whatever statistics they need into their per-slot state.
   Only a policy that overrides ``observe`` (or ``narrow``) makes the engine compute probabilities at all.
2. ``n_keep(n, limit)`` — how many slots to keep after the step, given ``n`` slots now (``n`` includes the new
   tokens) and the most the layer may hold (the budget for the prompt, the decode budget's limit afterwards; the
   policy's ``budget`` stays what its own parameters derive from).
3. ``keep_scores(slots)`` — if ``n_keep(n) < n``: a priority per slot, floating point or integer; the engine keeps
   the ``n_keep`` highest (``+inf``, or :data:`PROTECTED`, = kept). Empty and padding slots are never kept in place
   of real tokens.

A policy that overrides ``narrow(logits, allowed)`` restricts the keys of earlier steps each query head attends to
(``topk_oracle``); a step's own tokens are attended as by every policy, so a prompt on an empty cache is not narrowed.
A :class:`PositionalPolicy` gives priorities from positions alone (``priority(pos, last)``): every layer with the
same policy then evicts the same slots, and the engine decides once per step for all of them. A
:class:`PatternPolicy` states them as a :class:`~kvsieve.engine.rules.Pattern` (``local``, ``streaming_llm``,
``strided``, ``fixed``); a :class:`SinkWindow` (``local``, ``streaming_llm``) keeps the first ``sinks`` tokens and
the newest others: what a query sees when tokens arrive one at a time is known in closed form, so the stream
protocol attends whole chunks.

Per-slot state is declared by ``state_spec`` and stored by the engine next to the keys (slot dimension 2), so it
moves with its token when slots are evicted, compacted or reordered. New slots start at zero, or at what
``initial_state`` gives them.

A policy whose ``observe`` and ``keep_scores`` follow one of the rules the engine has as compiled loops states it
with ``scan_rule`` (:mod:`kvsieve.engine.rules`: ``ScoreRule``, ``LowMarks``, ``FixedPriority``): the stream
protocol's scan and a decode step's victim then run without calling them, with the same decisions. A policy of a
family states only its rule; the family's class (:mod:`kvsieve.policies.families`) is the rule's one torch
statement, which the compiled loops are tested against. A subclass that overrides one of the methods its rule stands for
(:data:`RULED`) without stating a rule of its own is run by its methods, never by the loops (``compiled_rule``).

A policy that scores tokens from the queries themselves, without attention weights (``expected_attention``),
overrides ``observe_queries(slots, queries, query_pos, rope)``: the engine hands it each step's queries (scaled, after
RoPE) and the model's RoPE frequencies, and attends with the fused kernel.

A policy that scores a context by passes of its own before compressing it (``kvzip``: the context reconstructed)
states them with ``probes``: :func:`kvsieve.compress_context` holds the context, feeds each probe through the model
(:meth:`~kvsieve.engine.cache.SieveCache.probing`: attended, observed, then removed) and compresses it.

A new policy is one file in this package with a :func:`register`-decorated subclass.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from kvsieve.engine.rules import PROTECTED, Pattern, ScanRule

if TYPE_CHECKING:
    from kvsieve.engine.rope import Rotary

SCORE_STATE: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"score": ((), torch.float32)}
"""The per-slot state of policies that accumulate one fp32 score per token."""


def accumulate(score: torch.Tensor, gain: torch.Tensor) -> None:
    """``score`` ``[B, H, N]`` += ``gain`` ``[B, H, b, N]`` summed over its query rows (a decode step's one row
    added without a reduction)."""
    score += gain[:, :, 0] if gain.shape[2] == 1 else gain.sum(dim=2)


def group_sum(per_head: torch.Tensor, query_pos: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, G, b, N]`` values per query head (a softmax's probabilities, or what a policy derives from them) →
    ``[B, H, b, N]`` summed over each KV head's GQA group, the rows of padding queries (``query_pos`` ``[B, b]`` < 0)
    zero; ``query_pos`` None: no row is padding. :attr:`Observation.probs` is this of the model's probabilities."""
    summed = per_head.sum(dim=2)
    return summed if query_pos is None else summed.mul_((query_pos >= 0)[:, None, :, None])


REGISTRY: dict[str, type[Policy]] = {}
"""Registered policies by name (filled by :func:`register` as the policy modules are imported)."""
P = TypeVar("P", bound="type[Policy]")


def register(cls: P) -> P:
    """Class decorator: register a policy under its ``name``."""
    if cls.name in REGISTRY:
        raise ValueError(f"a policy named {cls.name!r} is already registered ({REGISTRY[cls.name].__qualname__})")
    REGISTRY[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Asking:
    """How a request to the model is written after a context, for a policy's probes (:meth:`Policy.probes`): the
    caller's prompt layout (a chat template's user turn, or plain text)."""

    encode: Callable[[str], list[int]]
    """Text → its token ids, no special tokens added."""
    turn_end: Sequence[int]
    """The tokens after a request: the end of the user's turn and the assistant's header (empty without a template)."""


@dataclass(frozen=True)
class NoParams:
    """A policy without parameters."""


@dataclass
class Slots:
    """What a policy sees of one layer: ``N`` slots per (batch row, KV head)."""

    pos: torch.Tensor
    """``[B, H, N]`` original position of each slot's token (index among the row's real tokens); -1 = empty."""
    state: dict[str, torch.Tensor]
    """The policy's per-slot state, ``[B, H, N, ...]`` each (views: update in place)."""
    last: torch.Tensor
    """``[B]`` position of each row's newest token."""
    keys: torch.Tensor
    """``[B, H, N, D]`` cached keys (after RoPE), read-only."""
    values: torch.Tensor
    """``[B, H, N, D]`` cached values, read-only."""

    def prefix(self, n: int) -> Slots:
        """The first ``n`` slots (views; ``self`` when that is all of them; keys and values of ``n`` slots as they
        are: a store's view reads them decoded, already cut to the slots in use)."""
        if n == self.pos.shape[-1]:
            return self
        return Slots(
            pos=self.pos[:, :, :n],
            state={k: v[:, :, :n] for k, v in self.state.items()},
            last=self.last,
            keys=self.keys if self.keys.shape[2] == n else self.keys[:, :, :n],
            values=self.values if self.values.shape[2] == n else self.values[:, :, :n],
        )

    @property
    def age(self) -> torch.Tensor:
        """``[B, H, N]`` tokens since each slot's token (0 = newest); empty slots get a huge age."""
        age = self.last[:, None, None] - self.pos
        return age.masked_fill(self.pos < 0, torch.iinfo(age.dtype).max)


def visible_slots(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[B, H, b, N]``: which slots each query may attend to (causal by position, no empty slots, window).

    ``key_pos`` ``[B, H, N]`` and ``query_pos`` ``[B, b]`` are original positions (-1 = empty/padding). Padding
    queries may attend to everything: their outputs are never used, and a fully masked row would produce NaN.
    """
    kp = key_pos[:, :, None, :]
    qp = query_pos[:, None, :, None]
    allowed = (kp >= 0) & (kp <= qp)
    if window is not None:
        allowed &= kp > qp - window
    return allowed | (qp < 0)


@dataclass
class Observation:
    """The attention of one block of query rows over the ``N`` slots of a layer, as a policy sees it."""

    probs: torch.Tensor
    """``[B, H, b, N]`` fp32 probabilities (fp64 for a fp64 model), the query heads of each KV head's group summed;
    rows of padding queries are zero. They are the model's own: after logit soft-capping, and with attention sinks
    the tokens' share only (a query head's row then sums to less than 1)."""
    logits: torch.Tensor
    """``[B, H, G, b, N]`` scaled logits ``q·k/sqrt(d)`` per query head of the group (soft-capped where the model
    caps them), as the softmax saw them, ``-inf`` where masked."""
    query_pos: torch.Tensor
    """``[B, b]`` positions of the queries (-1 = padding)."""
    step_rows: int
    """Query rows of the whole step, over all its blocks (padding included): 1 for a decode step."""
    key_pos: torch.Tensor
    """``[B, H, N]`` positions of the slots' tokens (-1 = empty)."""
    window: int | None = None
    """The layer's sliding window (None = none)."""
    mask: torch.Tensor | None = field(default=None, repr=False)
    """The ``allowed`` mask if the engine has it (when every slot is visible: a True expanded, read-only); None:
    built from the positions on first use."""

    @property
    def allowed(self) -> torch.Tensor:
        """``[B, H, b, N]`` bool: the slots each query attended to (built on first use)."""
        if self.mask is None:
            self.mask = visible_slots(self.key_pos, self.query_pos, self.window)
        return self.mask


RULED = ("observe", "keep_scores", "n_keep", "state_spec", "initial_state")
"""What a :meth:`~Policy.scan_rule` stands for: the compiled loops run the rule in place of these methods."""


def _defining(cls: type, name: str) -> type:
    """The class in ``cls``'s method resolution order that defines ``name``."""
    return next(c for c in cls.__mro__ if name in vars(c))


def _rule_is_statement(cls: type) -> bool:
    """Whether none of :data:`RULED` is overridden below the class that states ``cls``'s scan rule."""
    owner = _defining(cls, "scan_rule")
    return all(issubclass(owner, _defining(cls, name)) for name in RULED)


class Policy:
    """Base class. Subclasses set ``name``, ``paper``, ``Params`` (a dataclass of their parameters) and override what
    they need. One instance serves one cache layer and knows that layer's ``budget`` (``None`` = unbounded)."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    bounded: ClassVar[bool] = True
    """Whether the policy enforces a budget (``full`` does not)."""
    row_additive: ClassVar[bool] = False
    """Whether observing query rows together in one step leaves the same state (and outputs) as observing them one
    step each (when nothing is evicted in between). The stream protocol then feeds the tokens that fit before the
    first eviction as one chunk. Policies that need no attention are chunked anyway."""
    reads_kv: ClassVar[bool] = False
    """Whether :meth:`observe` or :meth:`keep_scores` read ``slots.keys`` or ``slots.values``: the engine then passes
    them finished (otherwise a scan over quantized slots skips building each token's view of them) and lets a block
    of prompt rows observe every slot the layer holds, not just those before the block's own last token (which are
    all its rows see: the others would get zero), so that a statistic over the slots (ahakv's value prior) covers
    them all."""
    needs_attention: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`observe` or :meth:`narrow` (only then does the engine compute
    attention probabilities)."""
    narrows: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`narrow`."""
    positional: ClassVar[bool] = False
    """Whether priorities come from positions alone (true of a :class:`PositionalPolicy`, by type)."""
    counts_rows: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`n_keep` (its target is not simply ``min(n, budget)``). The rows
    of a left-padded batch hold different numbers of tokens, so the engine then applies ``n_keep`` to each row's
    own count, as if the row were alone."""
    needs_queries: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`observe_queries` (the engine then hands it each step's queries
    and builds the model's RoPE frequencies, refusing a model whose RoPE it cannot state)."""
    probed: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`probes` (it compresses a context only after passes of its
    own: a cache under it is filled by :func:`kvsieve.compress_context`)."""
    allocates_heads: ClassVar[bool] = False
    """Inferred: whether the policy overrides :meth:`share_heads` (its heads keep their own counts)."""
    rule_is_statement: ClassVar[bool] = True
    """Inferred: whether the class that states :meth:`scan_rule` also states, or inherits, everything its rule
    stands for (:data:`RULED`). A subclass that overrides one of them without stating its own rule is not run by
    the engine's compiled loops (:attr:`compiled_rule` is None): they would run the rule, not its code."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.narrows = cls.narrow is not Policy.narrow
        cls.needs_attention = cls.narrows or cls.observe is not Policy.observe
        cls.counts_rows = cls.n_keep is not Policy.n_keep
        cls.probed = cls.probes is not Policy.probes
        cls.needs_queries = cls.observe_queries is not Policy.observe_queries
        cls.allocates_heads = cls.share_heads is not Policy.share_heads
        cls.rule_is_statement = _rule_is_statement(cls)

    def __init__(self, budget: int | None, params: Any = None) -> None:
        self.params = self.Params() if params is None else params
        if not isinstance(self.params, self.Params):
            raise TypeError(f"{self.name}: params must be a {self.Params.__name__}, got {type(self.params).__name__}")
        if self.takes_budget() and (budget is None or budget <= 0):
            raise ValueError(f"{self.name}: budget must be a positive number of tokens, got {budget}")
        self.budget = budget if self.takes_budget() else None
        self.setup()
        self.rule: ScanRule | None = self.scan_rule()
        """:meth:`scan_rule`, stated once (the parameters never change)."""
        self.compiled_rule: ScanRule | None = self.rule if self.rule_is_statement else None
        """The rule the engine's compiled loops run in place of this policy's methods: :attr:`rule` where it is
        the policy's own statement (:attr:`rule_is_statement`), else None (the methods run). A plain attribute,
        which a compiled step reads without a lock."""

    @classmethod
    def takes_budget(cls) -> bool:
        """Whether the policy uses a budget: to bound the cache, or (unbounded and narrowing, ``topk_oracle``) as
        the number of keys each query attends to."""
        return cls.bounded or cls.narrows

    @classmethod
    def info(cls) -> dict[str, Any]:
        """What ``kvsieve policies`` lists: name, paper, summary, default parameters, what the policy needs."""
        return {
            "name": cls.name,
            "paper": cls.paper,
            "needs_attention": cls.needs_attention,
            "needs_queries": cls.needs_queries,
            "probed": cls.probed,
            "bounded": cls.bounded,
            "saves_memory": cls.bounded,
            "takes_budget": cls.takes_budget(),
            "params": {
                f.name: (f.default if f.default is not dataclasses.MISSING else None)
                for f in dataclasses.fields(cls.Params)
            },
            "summary": (cls.__doc__ or "").strip().splitlines()[0],
        }

    def setup(self) -> None:
        """Validate the parameters against the budget and derive the budget split (raise ValueError)."""

    @classmethod
    def parse_params(cls, **kwargs: Any) -> dict[str, Any]:
        """The given parameters, each checked against its annotation in ``Params`` (see :func:`parse_param`; text
        such as a command line's ``"true"`` or ``"16"`` is parsed); a ``ValueError`` names a bad or unknown one."""
        kinds = _annotations(cls.Params)
        unknown = sorted(set(kwargs) - set(kinds))
        if unknown:
            allowed = ", ".join(sorted(kinds)) or "none"
            raise ValueError(f"policy {cls.name!r} has no parameter(s) {', '.join(unknown)} (parameters: {allowed})")
        return {name: parse_param(cls.name, name, kinds[name], value) for name, value in kwargs.items()}

    @classmethod
    def make_params(cls, **kwargs: Any) -> Any:
        """Build ``Params`` from keyword arguments checked by :meth:`parse_params`."""
        return cls.Params(**cls.parse_params(**kwargs))

    def state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot state: name → (extra trailing dims, dtype)."""
        return {}

    def initial_state(self, keys: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-slot state of tokens being cached, from their keys ``[B, H, q, D]`` (as cached) and positions
        ``[B, H, q]`` (-1 = padding): name → ``[B, H, q, ...]``. States not named start at zero. Default: none.

        A priority that never changes once a token is cached is computed here, once per token, instead of over
        every slot at every step."""
        return {}

    def observe(self, slots: Slots, obs: Observation) -> None:
        """Accumulate statistics from one block of query rows (override it to get probabilities at all)."""

    def observe_queries(self, slots: Slots, queries: torch.Tensor, query_pos: torch.Tensor, rope: Rotary) -> None:
        """Score from a step's queries (override it to get them): ``queries`` ``[B, H, G, q, D]`` per KV head's
        group, multiplied by the model's attention scaling, after RoPE at their positions ``query_pos`` ``[B, q]`` (-1:
        padding); ``rope`` rotates by any position with the model's frequencies. Called at every step that may evict
        (and by probes), before the step's eviction, its tokens among ``slots``."""

    def observes_as(self) -> Hashable | None:
        """What :meth:`observe` computes, as a value that is equal for two policies whose observations of the same rows
        leave the same state (their :meth:`state_spec` alike, starting at zero), or None: like no other (the
        default). A shared prompt's pass (:class:`~kvsieve.engine.shared.SharedPrompt`) has the policies of one
        value observe once: the state is copied to the others."""
        return None

    def observed_rows(self) -> int | None:
        """How many of a step's last query rows :meth:`observe` counts (None: every row). What it leaves from the
        earlier rows must be what their observation would have left, so the engine computes their attention with
        the fused kernel (no probabilities) and hands :meth:`observe` the last rows only. Default: every row."""
        return None

    def narrow(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``[B, H, G, b, N]`` bool: which of the ``N`` slots held before the step each query head attends to
        (override it to narrow at all). The step's own slots are not passed: each query attends to them as every
        policy's queries do (an eviction policy's step, too, sees its own tokens and what the cache held before), so
        a step on an empty cache is never narrowed.

        ``logits`` ``[B, H, G, b, N]`` are the scaled logits, ``allowed`` ``[B, H, b, N]`` the engine's mask
        (causality, padding, window); the result must be a subset of it. Default: ``allowed`` unchanged (a view).
        """
        return allowed[:, :, None]

    def n_keep(self, n: int, limit: int | None = None) -> int:
        """Tokens to keep after a step that left a row ``n`` tokens, when the layer may hold ``limit`` (default: the
        budget; after the prompt, the engine passes the decode budget's limit)."""
        return min(n, self.budget if limit is None else limit) if self.bounded else n

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        """``[B, H, N]`` priority of each slot (higher = kept); called when a step leaves more than ``n_keep``."""
        raise NotImplementedError(f"{self.name} keeps everything: it has no priorities")

    def share_heads(self, scores: torch.Tensor, real: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Override it to let each KV head keep its own count: ``[B, H, N]``, the slots kept when a row's ``keep[b]``
        tokens per head (``H · keep[b]`` in all) are shared among its heads, from the priorities ``scores``
        ``[B, H, N]`` of the real slots ``real``. The engine calls it at a layer's first eviction, then keeps each
        (row, head) at its count (:meth:`~kvsieve.engine.storage.SlotStore.keep_heads`). Default: every head keeps
        ``keep`` (not called: the layer's slots are evicted as one)."""
        raise NotImplementedError(f"{self.name} keeps the same count in every head")

    def probes(self, context: Sequence[int], asking: Asking) -> list[list[int]]:
        """The token ids of the passes that score a held ``context`` (its token ids, as fed) before it is compressed,
        each fed after it and removed (:meth:`~kvsieve.engine.cache.SieveCache.probing`); ``asking``: how a request
        is written after it. Override it to be scored so (default: no probe; a cache compresses as it is fed)."""
        raise NotImplementedError(f"{self.name} scores a context as it is fed: it has no probes")

    def shares_budget(self) -> bool:
        """Whether the priorities of this policy's layers compare across layers, so that a held context is compressed
        by one selection over all of them (:meth:`~kvsieve.engine.cache.SieveCache.compress`: each layer keeps its
        share of the model's budget). Default: False (each layer keeps its own budget)."""
        return False

    def scan_rule(self) -> ScanRule | None:
        """What :meth:`observe`, :meth:`n_keep` and :meth:`keep_scores` compute, as a rule the engine's compiled loops
        run (:mod:`kvsieve.engine.compiled`: the stream protocol's scan, a decode step's victim), or None (the
        default): the engine calls them."""
        return None


class PositionalPolicy(Policy):
    """A policy whose priorities are a function of the slots' positions alone (``pos``, ``last``), never of keys,
    values or state: every layer with the same policy, parameters and budget holds the same positions and evicts the
    same slots, so the engine decides once per step for all of them."""

    positional = True

    def priority(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` priorities of the slots at positions ``pos`` ``[B, H, N]`` (-1 = empty) when each row's
        newest position is ``last`` ``[B]``."""
        raise NotImplementedError

    def keep_scores(self, slots: Slots) -> torch.Tensor:
        return self.priority(slots.pos, slots.last)


class PatternPolicy(PositionalPolicy):
    """A positional policy that keeps a :class:`~kvsieve.engine.rules.Pattern` at its budget: it writes
    :meth:`pattern` (its parameters as a pattern) and nothing else; its priorities are the pattern's, and a rule
    that keeps its pattern whatever the scores (the ``h2o+`` policies) runs compiled."""

    def __init__(self, budget: int | None, params: Any = None) -> None:
        super().__init__(budget, params)
        self.kept = self.pattern()
        """:meth:`pattern`, stated once (the parameters never change)."""

    def pattern(self) -> Pattern:
        """The pattern the policy keeps (called once, after ``setup``; ``keep`` is the budget)."""
        raise NotImplementedError

    def priority(self, pos: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.kept.priority(pos, last)


class SinkWindow(PatternPolicy):
    """Keeps the first ``sinks`` real tokens of each row and the newest others (the ``local`` window: no sinks).

    What a query sees when tokens are fed one at a time is known in closed form (:meth:`stream_visible`), so the
    stream protocol attends whole chunks of tokens at once."""

    sinks = 0
    """The first positions always kept (set by subclasses in ``setup``)."""

    def pattern(self) -> Pattern:
        return Pattern(keep=self.budget, recent=self.budget - self.sinks, sinks=self.sinks)

    def stream_visible(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """``[B, H, b, N]``: whether the query at ``query_pos`` ``[B, b]`` sees the token at ``key_pos``
        ``[B, H, N]`` (both ≥ 0) when tokens are fed one at a time: the sinks and ``i - (budget - sinks) .. i``
        (the kept tokens and itself)."""
        kp, qp = key_pos[:, :, None, :], query_pos[:, None, :, None]
        visible = kp >= qp - (self.budget - self.sinks)
        return visible | (kp < self.sinks) if self.sinks else visible


_BOOL_TEXT = {"true": True, "1": True, "false": False, "0": False}
_NONE_TEXT = ("none", "null")


@functools.cache
def _annotations(params: type) -> dict[str, Any]:
    """Field name → resolved annotation of a ``Params`` dataclass."""
    hints = typing.get_type_hints(params)
    return {f.name: hints[f.name] for f in dataclasses.fields(params)}


def _convert(kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (bool, int, float or a ``Literal``); a ``ValueError`` when it is not one."""
    if typing.get_origin(kind) is typing.Literal:
        if value in typing.get_args(kind):
            return value
    elif kind not in (bool, int, float):
        raise TypeError(f"unsupported parameter annotation {kind!r} (use bool, int, float or a Literal, maybe | None)")
    elif isinstance(value, str):
        if kind is not bool:
            return kind(value)  # int("2.5"), float("abc"): ValueError
        if value.strip().lower() in _BOOL_TEXT:
            return _BOOL_TEXT[value.strip().lower()]
    elif isinstance(value, bool):
        if kind is bool:
            return value
    elif kind is not bool and (isinstance(value, int) or (kind is float and isinstance(value, float))):
        return kind(value)
    raise ValueError(value)


def _expected(kind: Any) -> str:
    """What a value of ``kind`` looks like, for error messages."""
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    return {bool: "true/false", int: "an integer", float: "a number"}[kind]


def parse_param(policy: str, name: str, kind: Any, value: Any) -> Any:
    """``value`` of ``policy``'s parameter ``name`` checked against its annotation ``kind`` and converted.

    ``kind`` is bool, int, float or a ``Literal`` of choices, each possibly ``| None``. A bool takes a bool, an int
    an int (not a bool, not 2.5), a float an int or a float (stored as float), a choice one of its values, an
    optional one also None. Text is parsed: ``true``/``false``/``1``/``0`` (any case), numbers, ``none``/``null``.
    Anything else is a one-line ``ValueError`` naming the policy, the parameter and what it expects.
    """
    args = typing.get_args(kind)
    optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (kind,) = (arg for arg in args if arg is not type(None))
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_TEXT):
            return None
    try:
        return _convert(kind, value)
    except ValueError:
        expected = _expected(kind) + (" or none" if optional else "")
        raise ValueError(f"invalid value {value!r} for {policy} parameter {name!r} (expected {expected})") from None


@functools.cache
def extreme(dtype: torch.dtype, device: torch.device, *, highest: bool) -> torch.Tensor:
    """The 0-dim tensor of the highest priority (``inf``, or :data:`PROTECTED` for an integer type) or the lowest
    (``-inf``, or the integer type's least value) on ``device``: a tensor operand costs less than a Python number,
    which every call would wrap in a new tensor (these run at every token of a stream)."""
    if dtype.is_floating_point:
        value = float("inf") if highest else float("-inf")
    else:
        value = PROTECTED if highest else torch.iinfo(dtype).min
    with torch.inference_mode(False):  # (usable outside inference mode as well)
        return torch.tensor(value, dtype=dtype, device=device)


def protect(priority: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``priority`` with the slots of ``mask`` always kept (``+inf``, or :data:`PROTECTED` for an integer one)."""
    return torch.where(mask, extreme(priority.dtype, priority.device, highest=True), priority)


def demote(priority: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``priority`` with the slots of ``mask`` evicted first (``-inf``, or the integer type's least value)."""
    return torch.where(mask, extreme(priority.dtype, priority.device, highest=False), priority)


def best_of(priority: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]``: the ``counts`` highest ``priority`` slots of each (row, head) (``counts`` ``[B, H]``, or
    broadcasting to it), ties to the lower slot."""
    order = priority.argsort(dim=-1, descending=True, stable=True)
    first = torch.arange(priority.shape[-1], device=priority.device) < counts[..., None]
    return torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, first.expand_as(order))


def in_position_order(pos: torch.Tensor, fn: Callable[..., torch.Tensor], *values: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to ``values`` (``[B, H, N]`` each) laid out in position order along the slots (empty slots
    first), its ``[B, H, N]`` result put back in slot order: for rules over neighbouring positions."""
    order = pos.argsort(dim=-1, stable=True)
    result = fn(*(v.gather(-1, order) for v in values))
    return torch.empty_like(result).scatter_(-1, order, result)
