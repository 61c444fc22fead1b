"""``h2o+strided``, ``h2o+fixed``, ``h2o+local``: a positional pattern plus H2O heavy hitters."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, ClassVar

from kvsieve.engine.rules import ScoreRule
from kvsieve.policies.base import PatternPolicy, register
from kvsieve.policies.families import ScorePolicy
from kvsieve.policies.fixed import Fixed
from kvsieve.policies.h2o import H2O
from kvsieve.policies.local import Local
from kvsieve.policies.strided import Strided


class HeavyHitters(ScorePolicy):
    """A positional pattern at ``budget - heavy`` plus the ``heavy`` other tokens with the most accumulated attention.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
    NeurIPS 2023 (arXiv:2306.14048), the ablation of sparse-attention patterns with and without heavy hitters at
    the same budget (Tables 2 and 8, "with heavy hitters"); kvsieve offers it over ``strided``, ``fixed`` and
    ``local``. The paper gives no code for it; this is kvsieve's reading. Per (batch row, KV head) of a layer, at
    budget ``B``:

    - ``heavy = int(B · heavy_ratio)``; the base pattern is built at budget ``B - heavy`` with its own parameters,
      so its own defaults apply to its share (``strided``'s ``recent`` is ``(B - heavy) // 2``, ``fixed``'s
      ``block`` likewise);
    - a token's score is H2O's (``transform="identity"``): the attention probability it has received, accumulated
      in fp32 over every query row and step while it is held, its own step included; the query heads of a GQA
      group are summed, padding queries add nothing. Observing several rows at once leaves the same scores as
      one at a time (``row_additive``), so the stream protocol chunks the tokens before the first eviction;
    - after any step that leaves more than ``B`` tokens: the base pattern ranks the tokens held (real tokens only,
      never empty or padding slots) and its top ``B - heavy`` are kept; the ``heavy`` best-scored of the others
      are kept with them. After the prompt this is one selection; at a decode step the lowest-scored token outside
      the pattern's set goes.

    Choices: the pattern is applied to the tokens held at each step, as the base policy itself is (``fixed`` then
    depends on what was kept before; ``local`` and ``strided`` do not), so the pattern's part is exactly what the
    base policy alone would keep at ``B - heavy`` from the same tokens; a heavy hitter that the pattern would rank
    in its part later (a ``fixed`` block boundary, a ``strided`` candidate) moves there. The pattern's ties follow
    ``torch.topk``, as do ties of scores. ``heavy_ratio = 0`` is the base policy at ``B`` (tested: same kept
    positions). The combined policy is not positional (every layer decides alone, by its own scores). Every batch
    row keeps its own scores, like ``h2o``. The rule is a :class:`~kvsieve.engine.rules.ScoreRule` whose kept set
    is the base's :class:`~kvsieve.engine.rules.Pattern` (``score_rule``; its reading is tested to keep the base's
    top ``B - heavy``), run by the family's torch code (:class:`~kvsieve.policies.families.ScorePolicy`) or, on CPU,
    by the compiled loops, with the same decisions.
    """

    base: ClassVar[type[PatternPolicy]]
    """The positional pattern combined with heavy hitters (set by :func:`with_heavy_hitters`)."""
    row_additive = True

    def setup(self) -> None:
        ratio = self.params.heavy_ratio
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"{self.name}: heavy_ratio must be in [0, 1), got {ratio}")
        self.heavy = int(self.budget * ratio)
        self.share = self.budget - self.heavy  # >= 1, since heavy_ratio < 1
        names = [f.name for f in dataclasses.fields(self.base.Params)]
        base_params = self.base.Params(**{name: getattr(self.params, name) for name in names})
        try:
            self.base_policy = self.base(self.share, base_params)
        except ValueError as err:
            raise ValueError(
                f"{self.name}: {err} (the pattern's share: budget {self.budget} - heavy {self.heavy})"
            ) from None

    def score_rule(self) -> ScoreRule:
        return ScoreRule(accumulate=True, kept=self.base_policy.kept)


def with_heavy_hitters(base: type[PatternPolicy]) -> type[HeavyHitters]:
    """A registered policy ``h2o+<base.name>``: ``base``'s pattern at ``budget - heavy`` plus heavy hitters.

    Its ``Params`` is a frozen dataclass with ``base``'s parameters (same annotations and defaults) and
    ``heavy_ratio: float = 0.5``."""
    hints = typing.get_type_hints(base.Params)
    fields: list[Any] = [
        (f.name, hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(base.Params)
    ]
    if "heavy_ratio" in hints:
        raise ValueError(f"{base.name} already has a parameter named heavy_ratio")
    fields.append(("heavy_ratio", float, dataclasses.field(default=0.5)))
    stem = f"H2O{base.__name__}"
    params = dataclasses.make_dataclass(f"{stem}Params", fields, frozen=True)
    params.__module__ = __name__  # (make_dataclass's own module= is Python 3.12+)
    summary = (
        f"Keeps what ``{base.name}`` keeps at ``budget - heavy`` plus the ``heavy`` other tokens with the most "
        "accumulated attention (H2O's heavy hitters)."
    )
    doc = inspect.cleandoc(HeavyHitters.__doc__ or "").split("\n", 1)[1]
    cls = type(
        stem,
        (HeavyHitters,),
        {
            "__doc__": f"{summary}\n{doc}",
            "__module__": __name__,
            "__qualname__": stem,
            "name": f"h2o+{base.name}",
            "paper": f"{H2O.paper}, Tables 2 and 8 (with heavy hitters); pattern: {base.paper}",
            "base": base,
            "Params": params,
        },
    )
    return register(cls)


H2OStrided = with_heavy_hitters(Strided)
H2OFixed = with_heavy_hitters(Fixed)
H2OLocal = with_heavy_hitters(Local)
