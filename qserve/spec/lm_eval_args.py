"""lm-eval's evaluation options, the same on both models: one typed form from the command line or a
recipe's `eval` section to `lm_eval.simple_evaluate`, the baseline cache key and the eval record.

Light on purpose (lm-eval is imported only to parse): `qserve serve` may read a record's options
against its recipe's (lm_eval_differences) without the evaluation stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from qserve.errors import InvalidSpec

# simple_evaluate's four seed keywords, in the order of lm-eval's --seed (python, numpy, torch, few-shot sampler)
SEED_NAMES = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
Seeds = tuple[int | None, int | None, int | None, int | None]


@dataclass(frozen=True)
class LmEvalArgs:
    """lm-eval's options as given; None: not given (the recipe's, else lm-eval's default).

    `gen_kwargs` as lm-eval parses `k=v,k=v` (its values typed); `seed` as lm-eval's --seed fills it.
    """

    num_fewshot: int | None = None
    apply_chat_template: bool | str | None = None
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None
    gen_kwargs: tuple[tuple[str, Any], ...] | None = None
    seed: Seeds | None = None

    @classmethod
    def parse(cls, cli: bool = True, **given: Any) -> LmEvalArgs:
        """Checked values from the command line (`cli`) or a recipe's eval section; InvalidSpec names the option."""
        name = _namer(cli)
        num = given.get("num_fewshot")
        if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 0):
            raise InvalidSpec(f"{name('num_fewshot')} takes a number of examples, 0 or more; got {num!r}")
        template = given.get("apply_chat_template")
        return cls(
            num_fewshot=num,
            apply_chat_template=True if template == "" else template,  # a bare --apply-chat-template
            fewshot_as_multiturn=given.get("fewshot_as_multiturn"),
            system_instruction=given.get("system_instruction"),
            gen_kwargs=_gen_kwargs(given.get("gen_kwargs"), name("gen_kwargs")),
            seed=_seeds(given.get("seed"), name("seed")),
        )

    @classmethod
    def from_recipe(cls, section: dict[str, Any] | None) -> LmEvalArgs:
        return cls.parse(cli=False, **(section or {}))

    def over(self, base: LmEvalArgs) -> LmEvalArgs:
        """These options where given, `base`'s (a recipe's) elsewhere."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        return LmEvalArgs(**{k: getattr(base, k) if v is None else v for k, v in mine.items()})

    def check(self, cli: bool = True) -> None:
        """What lm-eval would refuse only once it runs, refused before any work."""
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            name = _namer(cli)
            raise InvalidSpec(
                f"{name('fewshot_as_multiturn')} needs {name('apply_chat_template')}: lm-eval lays few-shot examples out "
                "as chat turns only through a chat template (it refuses the one without the other)"
            )

    def resolved(self) -> dict[str, Any]:
        """simple_evaluate's keywords, with lm-eval's defaults where nothing was given (as its CLI fills them:
        few-shot as multi-turn follows the chat template)."""
        from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

        template = self.apply_chat_template or False
        multiturn = bool(template) if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn
        seeds = self.seed or (DEFAULT_RANDOM_SEED, DEFAULT_OTHER_SEED, DEFAULT_OTHER_SEED, DEFAULT_OTHER_SEED)
        return {
            "num_fewshot": self.num_fewshot,
            "apply_chat_template": template,
            "fewshot_as_multiturn": multiturn,
            "system_instruction": self.system_instruction,
            "gen_kwargs": dict(self.gen_kwargs) if self.gen_kwargs else None,
            **dict(zip(SEED_NAMES, seeds, strict=True)),
        }


def _namer(cli: bool) -> Callable[[str], str]:
    """An option's name as the user wrote it: --num-fewshot on the command line, num_fewshot in a recipe."""
    return (lambda field: "--" + field.replace("_", "-")) if cli else (lambda field: field)


def _gen_kwargs(value: str | dict[str, Any] | None, name: str) -> tuple[tuple[str, Any], ...] | None:
    """`k=v,k=v` parsed by lm-eval's own parser (what simple_evaluate does with a string), or a recipe's mapping.
    lm-eval splits on every comma and keeps a piece without `=` as a key with an empty value: refused here."""
    if value is None or isinstance(value, dict):
        return tuple(value.items()) if value else None
    from lm_eval.utils import simple_parse_args_string

    for piece in (p for p in str(value).split(",") if p):
        if "=" not in piece or not piece.split("=", 1)[0].strip():
            raise InvalidSpec(
                f"{name} {value!r}: {piece!r} is not KEY=VALUE; lm-eval splits on every comma, so give pairs such as "
                "temperature=0,max_gen_toks=256 (no lists)"
            )
    return tuple(simple_parse_args_string(str(value)).items()) or None


def _seeds(value: str | int | list[Any] | None, name: str) -> Seeds | None:
    """lm-eval's --seed: one value for all four, or python,numpy,torch[,fewshot] ('None' leaves one unset),
    parsed by lm-eval's own argument type."""
    if value is None:
        return None
    from lm_eval._cli.utils import _int_or_none_list_arg_type

    text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
    try:
        seeds = _int_or_none_list_arg_type(3, 4, "0,1234,1234,1234", text)  # lm-eval's --seed type and default
    except ValueError as exc:
        raise InvalidSpec(f"{name} {text!r}: {exc} (one value for all four, or python,numpy,torch,fewshot)") from None
    return tuple(seeds)  # type: ignore[return-value]


def lm_eval_differences(asked: LmEvalArgs, request: dict[str, Any] | None) -> list[str]:
    """Where the options a record was made with (its request's `lm_eval`) differ from those a recipe's eval
    section names (`asked`); empty when it names none or they match. For serve: a record made otherwise
    does not meet a policy that names them."""
    named = [f.name for f in fields(asked) if getattr(asked, f.name) is not None]
    used = (request or {}).get("lm_eval")
    if not named:
        return []
    if used is None:
        return [f"the record does not say which lm-eval options it was made with (the recipe names {', '.join(named)})"]
    wanted = asked.resolved()
    keys = list(dict.fromkeys(k for n in named for k in _resolved_keys(n)))
    return [
        f"{k}: the record was made with {used.get(k)!r}, the recipe names {wanted[k]!r}" for k in keys if used.get(k) != wanted[k]
    ]


def _resolved_keys(name: str) -> tuple[str, ...]:
    """The simple_evaluate keywords an option decides (a chat template also decides multi-turn's default)."""
    return {"seed": SEED_NAMES, "apply_chat_template": ("apply_chat_template", "fewshot_as_multiturn")}.get(name, (name,))
