"""Caption -> Gemma-2 embedding, as NVlabs Sana trains and diffusers' SanaPipeline conditions.

Training must see the embeddings inference will feed, so this follows Sana's
``train_scripts/train.py`` (the text-feature branch for gemma) and
``SanaPipeline.encode_prompt`` / ``_get_gemma_prompt_embeds`` (diffusers 0.42), which agree
on every step but the first: the optional complex-human-instruction (CHI) prefix, right
padding to ``max_length_all`` (N, or CHI tokens + N - 2), Gemma-2 with the attention mask,
then keep the first token and the last N-1 positions (``select_index = [0] +
list(range(-N + 1, 0))``, Sana paper section 3.1). Without CHI that selection is the identity.

The first step is the caption text (``--caption-text`` of precompute, recorded as
``TextConditioning.caption_text``): ``sana`` (default) prefixes the CHI to the raw caption,
as Sana's train.py does (``prompt = [chi_prompt + i for i in batch[1]]``); ``diffusers``
lower-cases and strips it first, as the pipeline's ``_text_preprocessing`` does with
``clean_caption=False``.

The selected mask is always a prefix of ones (padding is on the right), so a caption is
stored as its first ``mask.sum()`` rows only; ``training.data`` restores the padding.
The empty caption for classifier-free guidance is encoded without CHI, as Sana's train.py
encodes its ``null_embed`` (``tokenizer("", max_length=N, padding="max_length")``) and the
pipeline its negative prompt, and is stored whole: all N rows, the padding positions'
encodings included, because Sana's dropout swaps in the full null encoding
(training/objective.py).

Which CHI (``--chi`` of precompute): ``sana`` (default) is the ``text_encoder.chi_prompt``
list every NVlabs Sana training config uses (NVlabs/Sana
configs/sana_config/512ms/Sana_600M_img512.yaml and 1024ms/Sana_1600M_img1024.yaml; the
training scripts prefix it in train_scripts/train.py); ``diffusers`` is the default of
``SanaPipeline.__call__(complex_human_instruction=...)``, the same eight lines except that
the first one quotes 'Enhanced prompt' with single instead of double quotes (so other
tokens); ``none`` trains without it. What was used is recorded as ``TextConditioning`` in
the feature index, every checkpoint and the exported directory, so inference can pass the
same list.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from training.errors import UserError

log = logging.getLogger(__name__)

#: NVlabs Sana's complex human instruction, ``text_encoder.chi_prompt`` of its training
#: configs (NVlabs/Sana configs/sana_config/1024ms/Sana_1600M_img1024.yaml, identical in
#: 512ms/Sana_600M_img512.yaml). Data, not code: it must match token for token.
SANA_CHI: tuple[str, ...] = (
    'Given a user prompt, generate an "Enhanced prompt" that provides detailed visual descriptions suitable for '
    'image generation. Evaluate the level of detail in the user prompt:',
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
    "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street "
    "lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass "
    "skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)
#: ``--chi`` names precompute takes besides a file path
CHI_CHOICES = ("sana", "diffusers", "none")
#: ``--caption-text``: "sana" = the raw caption (Sana's train.py), "diffusers" = lower-cased and
#: stripped (SanaPipeline ``_text_preprocessing`` with ``clean_caption=False``)
CAPTION_TEXT = ("sana", "diffusers")
#: file an exported / pretrained transformer directory records its text conditioning in
CONDITIONING_FILE = "text_conditioning.json"


@functools.cache
def default_complex_human_instruction() -> tuple[str, ...]:
    """The pipeline's own default CHI list, read from its signature (no copy to drift)."""
    import inspect

    from diffusers import SanaPipeline

    return tuple(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


def resolve_chi(choice: str) -> tuple[str, ...] | None:
    """``--chi`` value -> the instruction lines (None = no CHI). A file holds one line each."""
    if choice == "none":
        return None
    if choice == "sana":
        return SANA_CHI
    if choice == "diffusers":
        return default_complex_human_instruction()
    return tuple(Path(choice).read_text().splitlines())


def chi_name(lines: Sequence[str] | None) -> str:
    """What a CHI list is: "sana", "diffusers", "none" or "custom" (by content, not by flag)."""
    if not lines:
        return "none"
    if tuple(lines) == SANA_CHI:
        return "sana"
    if tuple(lines) == default_complex_human_instruction():
        return "diffusers"
    return "custom"


def chi_sha256(lines: Sequence[str] | None) -> str | None:
    """sha256 of the exact prefix the captions get (``"\\n".join(lines)``); None without CHI."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest() if lines else None


def dir_fingerprint(path: str | Path) -> str:
    """A cheap identity of a model directory: sha256 over every file's relative name and size
    plus the full bytes of its small JSON/text files (configs, tokenizer.json). Weights are
    not re-read (Gemma-2-2B is 5 GB); a changed config, tokenizer or weight file size shows."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(file.relative_to(root))
        digest.update(f"{rel}\0{file.stat().st_size}\0".encode())
        if file.suffix in (".json", ".txt", ".model") and file.stat().st_size < 64 * 2**20:
            digest.update(file.read_bytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class TextConditioning:
    """How captions became embeddings: what the transformer learns to expect.

    Recorded in index.json (``text_conditioning``), copied into every checkpoint's
    provenance and into an exported directory (``text_conditioning.json``)."""

    #: "sana" | "diffusers" | "none" | "custom" (by content) | "unknown" (not recorded)
    chi: str
    #: the instruction lines (what to pass as SanaPipeline's complex_human_instruction)
    complex_human_instruction: tuple[str, ...] | None = None
    chi_sha256: str | None = None
    #: N, SanaPipeline's max_sequence_length
    max_text_tokens: int | None = None
    #: {"path", "class", "vocab_size", "fingerprint"}
    tokenizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: {"path", "class", "name_or_path", "hidden_size", "num_hidden_layers", "dtype", "fingerprint"}
    text_encoder: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: how the caption text was prepared before the CHI: "sana" (raw) or "diffusers" (lower +
    #: strip); None = not recorded (features from before the choice existed: lower + strip)
    caption_text: str | None = None

    @classmethod
    def of(cls, lines: Sequence[str] | None, *, max_text_tokens: int | None = None,
           tokenizer: Mapping[str, Any] | None = None, text_encoder: Mapping[str, Any] | None = None,
           caption_text: str | None = None) -> TextConditioning:
        lines = tuple(lines) if lines else None
        return cls(chi=chi_name(lines), complex_human_instruction=lines, chi_sha256=chi_sha256(lines),
                   max_text_tokens=max_text_tokens, tokenizer=dict(tokenizer or {}),
                   text_encoder=dict(text_encoder or {}), caption_text=caption_text)

    @property
    def known(self) -> bool:
        return self.chi != "unknown"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["complex_human_instruction"] = list(self.complex_human_instruction or []) or None
        out["tokenizer"], out["text_encoder"] = dict(self.tokenizer), dict(self.text_encoder)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> TextConditioning:
        """Inverse of ``to_dict``; None or {} -> ``chi == "unknown"``."""
        if not data or data.get("chi", "unknown") == "unknown":
            return cls(chi="unknown", max_text_tokens=(data or {}).get("max_text_tokens"))
        lines = data.get("complex_human_instruction")
        return cls(chi=data["chi"], complex_human_instruction=tuple(lines) if lines else None,
                   chi_sha256=data.get("chi_sha256"), max_text_tokens=data.get("max_text_tokens"),
                   tokenizer=dict(data.get("tokenizer") or {}), text_encoder=dict(data.get("text_encoder") or {}),
                   caption_text=data.get("caption_text"))

    @classmethod
    def from_index(cls, raw: Mapping[str, Any]) -> TextConditioning:
        """From an index.json dict. Indexes written before ``text_conditioning`` existed: the
        older precompute recorded ``created_by.complex_human_instruction`` (a list or null),
        which still tells the CHI; anything else (e.g. synthetic features) is "unknown"."""
        if raw.get("text_conditioning"):
            return cls.from_dict(raw["text_conditioning"])
        created = raw.get("created_by") or {}
        if "complex_human_instruction" in created:
            return cls.of(created["complex_human_instruction"], max_text_tokens=raw.get("max_text_tokens"),
                          tokenizer={"path": created.get("tokenizer")},
                          text_encoder={"path": created.get("text_encoder")})
        return cls(chi="unknown", max_text_tokens=raw.get("max_text_tokens"))

    def describe(self) -> str:
        sha = f" sha256 {self.chi_sha256[:12]}" if self.chi_sha256 else ""
        return f"CHI {self.chi}{sha}, max_text_tokens {self.max_text_tokens}"


def expected_conditioning(pretrained_dir: str | Path | None) -> TextConditioning:
    """What a pretrained transformer expects: its directory's ``text_conditioning.json``
    (training.export writes it), else Sana's CHI with N=300 - what NVlabs' released weights
    (Efficient-Large-Model/Sana_*_diffusers) were trained with (their configs above)."""
    if pretrained_dir is not None and (Path(pretrained_dir) / CONDITIONING_FILE).is_file():
        return TextConditioning.from_dict(json.loads((Path(pretrained_dir) / CONDITIONING_FILE).read_text()))
    return TextConditioning.of(SANA_CHI, max_text_tokens=300)


def warn_if_unexpected(pretrained: str | None, model: torch.nn.Module, data: TextConditioning, *,
                       source: str, enabled: bool = True) -> str | None:
    """Once per run (rank 0): warn when fine-tuning ``model.pretrained`` on features made with
    another CHI (or N) than the weights expect. Returns the warning (tests), or None."""
    if not pretrained or not enabled:
        return None
    local = getattr(model, "config", {}).get("_name_or_path")  # diffusers records the dir it loaded
    want = expected_conditioning(local)
    if not data.known:
        msg = (f"model.pretrained {pretrained} expects {want.describe()}, but data.path {source} does not record "
               "its text conditioning (features from an older precompute); check it was made with --chi "
               f"{want.chi if want.chi in CHI_CHOICES else 'FILE'}, or re-run precompute")
    elif data.chi_sha256 != want.chi_sha256 or (
            want.max_text_tokens is not None and data.max_text_tokens != want.max_text_tokens):
        msg = (f"model.pretrained {pretrained} expects {want.describe()}, but data.path {source} has "
               f"{data.describe()}: the fine-tuned model would be conditioned differently from how it was "
               f"trained; re-run precompute with --chi {want.chi if want.chi in CHI_CHOICES else 'FILE'} "
               f"--max-text-tokens {want.max_text_tokens}, or accept the change knowingly")
    else:
        return None
    log.warning("text conditioning: %s", msg)
    return msg


def caption_prompts(captions: Sequence[str], caption_text: str) -> list[str]:
    """The caption text the CHI is prefixed to (see the module docstring)."""
    if caption_text not in CAPTION_TEXT:
        raise ValueError(f"caption_text: {caption_text!r} is not one of {', '.join(CAPTION_TEXT)}")
    return list(captions) if caption_text == "sana" else [c.lower().strip() for c in captions]


@torch.no_grad()
def encode_captions(captions: Sequence[str], tokenizer, text_encoder, *, max_tokens: int = 300,
                    complex_human_instruction: Sequence[str] | None = None, caption_text: str = "sana"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded embeddings ``[B, max_tokens, D]`` and mask ``[B, max_tokens]`` (in the text
    encoder's dtype, on its device). ``caption_text="diffusers"`` gives exactly what
    SanaPipeline.encode_prompt gives (tests/training/data/test_precompute.py)."""
    device = next(text_encoder.parameters()).device
    tokenizer.padding_side = "right"
    prompts = caption_prompts(captions, caption_text)
    if complex_human_instruction:
        chi = "\n".join(complex_human_instruction)
        prompts = [chi + p for p in prompts]
        max_length_all = len(tokenizer.encode(chi)) + max_tokens - 2
    else:
        max_length_all = max_tokens
    tokens = tokenizer(prompts, padding="max_length", max_length=max_length_all, truncation=True,
                       add_special_tokens=True, return_tensors="pt")
    mask = tokens.attention_mask.to(device)
    embeds = text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0]
    select = [0] + list(range(-max_tokens + 1, 0))
    return embeds[:, select], mask[:, select]


def real_tokens(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Per caption, the rows under the mask (``[n_real, D]``, CPU): what a shard stores."""
    out = []
    for e, m in zip(embeds, mask, strict=True):
        n = int(m.sum())
        if not bool(m[:n].all()):
            raise ValueError("attention mask is not a prefix of ones; the tokenizer must pad on the right")
        out.append(e[:n].detach().cpu())
    return out


def encode_for_shards(captions: Sequence[str], tokenizer, text_encoder, *, max_tokens: int = 300,
                      complex_human_instruction: Sequence[str] | None = None,
                      caption_text: str = "sana") -> list[torch.Tensor]:
    embeds, mask = encode_captions(captions, tokenizer, text_encoder, max_tokens=max_tokens,
                                   complex_human_instruction=complex_human_instruction, caption_text=caption_text)
    return real_tokens(embeds, mask)


def null_caption(tokenizer, text_encoder, *, max_tokens: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty caption's full encoding ``[N, D]`` (CPU) and its own mask ``[N]`` (Gemma:
    ``<bos>`` then padding, mask ``[1, 0, ...]``): Sana's ``null_embed``, which its dropout
    swaps in whole (NVlabs Sana train_scripts/train.py ``null_token_emb``;
    diffusion/utils/checkpoint.py loads it as ``y_embedder.y_embedding``)."""
    embeds, mask = encode_captions([""], tokenizer, text_encoder, max_tokens=max_tokens)
    return embeds[0].detach().cpu(), mask[0].detach().cpu().to(torch.int64)


def export_conditioning(transformer_dir: Path) -> TextConditioning:
    """The text conditioning an export records (training/checkpoint/export.py writes it): how its
    prompts must be encoded, as the training captions were."""
    path = transformer_dir / CONDITIONING_FILE
    if not path.is_file():
        raise UserError(f"--transformer {transformer_dir}: no {CONDITIONING_FILE} (not a training.export "
                        "directory?); prompts must be encoded as the training captions were")
    conditioning = TextConditioning.from_dict(json.loads(path.read_text()))
    if not conditioning.known or not conditioning.max_text_tokens:
        raise UserError(f"--transformer {transformer_dir}/{CONDITIONING_FILE}: the text conditioning is "
                        "unknown (features from an older precompute); re-export from a run whose features "
                        "record it")
    return conditioning


def recorded_component_dir(flag: str, given: str | None, recorded: dict[str, Any], what: str) -> Path:
    """The text encoder or tokenizer directory to use: ``given``, else the one the export records."""
    source = given or recorded.get("path")
    if not source:
        raise UserError(f"{flag}: not given and the export does not record the {what} its captions were "
                        f"encoded with; pass {flag} DIR")
    path = Path(source)
    if not path.is_dir():
        raise UserError(f"{flag} {path}: not a directory")
    return path


def check_recorded_fingerprint(flag: str, path: Path, recorded: dict[str, Any], allow: bool) -> None:
    """Refuse (unless ``allow``) a directory whose fingerprint is not the one the captions were encoded with."""
    want = recorded.get("fingerprint")
    if want and dir_fingerprint(path) != want and not allow:
        raise UserError(f"{flag} {path}: differs from the {flag[2:]} the training captions were encoded with "
                        f"({recorded.get('path')}, fingerprint {want[:12]}); using it would condition the model "
                        "otherwise than it was trained; pass that directory, or --allow-conditioning-mismatch")
