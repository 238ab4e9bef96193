"""The set of token ids that end a generation: every place a checkpoint declares one, united.

A checkpoint's files disagree: Qwen 3's tokenizer says eos_token is <|endoftext|> while its chat
turns end with <|im_end|>; Gemma 3's generation_config lists both <eos> and <end_of_turn>. Stopping
at any one of them alone runs chat answers on into the next turn, so the union is taken of
generation_config.json `eos_token_id` (int or list), config.json `eos_token_id` (also a nested
`text_config`), the tokenizer's eos token and the chat template's end-of-turn token.
"""

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def collect_eos_token_ids(
    model_dir: str | Path,
    *,
    tokenizer_eos_token_id: int | None = None,
    end_of_turn_token_id: int | None = None,
) -> frozenset[int]:
    """The union described above; logs where each id came from (call it once per load)."""
    model_dir = Path(model_dir)
    sources: dict[str, list[int]] = {
        "generation_config.json": _declared_ids(model_dir / "generation_config.json"),
        "config.json": _declared_ids(model_dir / "config.json"),
        "tokenizer eos_token": _as_ids(tokenizer_eos_token_id),
        "chat template end-of-turn": _as_ids(end_of_turn_token_id),
    }
    eos_ids = frozenset(token_id for ids in sources.values() for token_id in ids)
    if not eos_ids:
        raise ValueError(
            f"no EOS token id found for {model_dir}: generation_config.json, config.json, the tokenizer and "
            "the chat template declare none; pass stop_token_ids or ignore_eos=True"
        )
    described = "; ".join(f"{name}: {ids}" for name, ids in sources.items() if ids)
    logger.info("EOS token ids %s (%s)", sorted(eos_ids), described)
    return eos_ids


def _declared_ids(path: Path) -> list[int]:
    if not path.is_file():
        return []
    raw = json.loads(path.read_text())
    ids = _as_ids(raw.get("eos_token_id"))
    if isinstance(raw.get("text_config"), dict):
        ids += _as_ids(raw["text_config"].get("eos_token_id"))
    return ids


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    for token_id in values:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"eos_token_id must be an int >= 0 or a list of them, got {value!r}")
    return list(values)


def eos_token_ids_of(loaded) -> frozenset[int]:
    """The EOS set of an `infer.models.LoadedModel`: its folder's declarations, its tokenizer's EOS
    and its chat template's end-of-turn token."""
    template = loaded.chat_template
    end_of_turn = getattr(template, "end_of_turn_token", None) if template else None
    return collect_eos_token_ids(
        loaded.path,
        tokenizer_eos_token_id=loaded.tokenizer.eos_token_id,
        end_of_turn_token_id=loaded.tokenizer.token_id(end_of_turn) if end_of_turn else None,
    )
