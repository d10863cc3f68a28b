"""Multi-token-prediction layers in `partc verify` (DeepSeek-V3's `num_nextn_predict_layers`).

transformers builds no MTP layer (it drops `model.layers.{N}` on load), so the reference model
has none. Its parts are modules transformers does build, though: the MTP layer's block is a
decoder layer of the same config (a sparse one: `DeepseekV3DecoderLayer` past
`first_k_dense_replace`), `embed_tokens` an embedding, `enorm` / `hnorm` / `shared_head.norm`
the model's RMSNorm, `eh_proj` a linear map [2H] -> [H] and `shared_head.head` a head. So:

- the reference checkpoint gets seeded random MTP layers under DeepSeek's released names
  (`model.layers.{N + i}.self_attn...`, `.embed_tokens`, `.enorm`, `.hnorm`, `.eh_proj`,
  `.shared_head.{norm,head}`): each is a one-layer sparse causal LM of the same config built
  by transformers (its layer, embedding, final norm and head renamed to the MTP names), plus
  the two norms and `eh_proj`;
- `MtpSession` loads an MTP layer from such tensors as transformers loads that one-layer model
  (its own on-disk to in-memory conversion: stacked experts included), wires it as DeepSeek's
  MTP module computes (`h = eh_proj([enorm(embed(t + 1)); hnorm(h_prev)])`, the block, then
  `shared_head.head(shared_head.norm(h))`), runs it on the main model's last hidden state and
  the next tokens, and is a `Session` to the tensor-parallel and expert checks: each MTP module
  (`model.layers.{N}.self_attn`, `.mlp`, its experts, the norms, `eh_proj`, the embedding and
  the head) is checked like a decoder layer's.

What this proves: the family's split of every MTP tensor is the one its module needs, at the
topology checked, and each rank's tensors are the checkpoint's bytes. What it does not: that
the wiring above is the engine's (it is DeepSeek's and vLLM's `deepseek_mtp`), that the MTP
layer's block is what DeepSeek trained (a decoder layer of the config is assumed), nor the
MTP output's accuracy — the weights are random.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from partc.verify.reference import NOISE, build_reference, load_model, require_libraries
from partc.verify.session import Session, first_tensor

MTP_FIELD = "num_nextn_predict_layers"
"""The config field counting the MTP layers (DeepSeek-V3, GLM-4-MoE)."""
GLUE = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
"""The MTP layer's modules beside its decoder block, as DeepSeek names them."""


def mtp_layers(config: dict[str, Any]) -> range:
    """The layer indices of the config's MTP layers (after its decoder layers)."""
    base = int(config.get("num_hidden_layers") or 0)
    return range(base, base + int(config.get(MTP_FIELD) or 0))


def _host_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config of a one-layer causal LM whose layer is sparse: an MTP layer's block."""
    out = {**config, "num_hidden_layers": 1, MTP_FIELD: 0}
    if "first_k_dense_replace" in out:
        out["first_k_dense_replace"] = 0
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][-1:]
    return out


def _host_names(layer: int) -> dict[str, str]:
    """On-disk name prefix of the one-layer host -> the MTP layer's."""
    return {"model.layers.0.": f"model.layers.{layer}.",
            "model.embed_tokens.": f"model.layers.{layer}.embed_tokens.",
            "model.norm.": f"model.layers.{layer}.shared_head.norm.",
            "lm_head.": f"model.layers.{layer}.shared_head.head."}


def _renamed(name: str, prefixes: dict[str, str]) -> str | None:
    """`name` with the longest of `prefixes` it begins with replaced (None: none)."""
    old = max((p for p in prefixes if name.startswith(p)), key=len, default=None)
    return None if old is None else prefixes[old] + name[len(old):]


def keep_mtp(config: dict[str, Any], reference: dict[str, Any], notes: list[str]) -> None:
    """A shrunk reference config keeps one MTP layer of a config that has some (the shrink
    drops them, as transformers builds none; verify builds it here), its note changed to
    say so."""
    asked = int(config.get(MTP_FIELD) or 0)
    if asked and not reference.get(MTP_FIELD):
        reference[MTP_FIELD] = 1
        item = f"{MTP_FIELD} {asked} -> 0"
        dropped = re.compile(rf"{item}, |, {item}|{item}")
        notes[:] = [dropped.sub("", n) for n in notes]
        if asked > 1:
            notes.append(f"shrunk MTP layers: {MTP_FIELD} {asked} -> 1")


def add_mtp_layers(config: dict[str, Any], folder: Path, seed: int) -> list[str]:
    """Append seeded random MTP layers of `config` to the reference checkpoint in `folder`
    (none without `num_nextn_predict_layers`); their tensor names."""
    layers = mtp_layers(config)
    if not layers:
        return []
    from safetensors.torch import load_file, save_file

    torch, _ = require_libraries()
    tensors = load_file(str(folder / "model.safetensors"))
    hidden = int(config["hidden_size"])
    added = []
    for layer in layers:
        host = folder.parent / f"mtp-host-{layer}"
        build_reference(_host_config(config), host, seed + 1 + layer)
        prefixes = _host_names(layer)
        for name, value in sorted(load_file(str(host / "model.safetensors")).items()):
            renamed = _renamed(name, prefixes)
            if renamed is not None:
                tensors[renamed] = value
                added.append(renamed)
        shutil.rmtree(host)
        generator = torch.Generator().manual_seed(seed + 1 + layer)
        glue = {"enorm.weight": 1 + NOISE * torch.randn(hidden, generator=generator),
                "hnorm.weight": 1 + NOISE * torch.randn(hidden, generator=generator),
                "eh_proj.weight": NOISE * torch.randn(hidden, 2 * hidden, generator=generator)}
        for name, value in glue.items():
            tensors[f"model.layers.{layer}.{name}"] = value
            added.append(f"model.layers.{layer}.{name}")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sorted(added)


class MtpSession(Session):
    """The reference model's MTP layers as a `Session`: a model wired from one-layer hosts
    loaded by transformers, its inputs the main model's last hidden state and the next
    tokens, its modules those of each MTP layer."""

    def __init__(self, main: Session, config: dict[str, Any]) -> None:  # noqa: PLR0915
        self.torch = main.torch
        self.folder, self.work = main.folder, main.work
        self.layers = mtp_layers(config)
        self.config = config
        self.shapes, self.full = main.shapes, main.full  # every tensor: ranks hold them all
        prefixes = tuple(f"model.layers.{layer}." for layer in self.layers)
        self.names = [n for n in main.names if n.startswith(prefixes)]
        self.count = 0
        self._reaches: dict[str, bool | None] = {}
        hidden: list[Any] = []
        norm = main.model.get_submodule(_final_norm(main.model))
        handle = norm.register_forward_pre_hook(lambda _, args: hidden.append(args[0]))
        try:
            with self.torch.no_grad():
                main.model(**main.inputs, use_cache=False)
        finally:
            handle.remove()
        self.ids = self.torch.roll(main.ids, -1, dims=-1)  # position i: the token i + 1
        self.inputs = {"input_ids": self.ids, "hidden": hidden[0]}
        tagged = {n: np.full(self.shapes[n], float(i + 1), np.float32)
                  for i, n in enumerate(self.names)}
        self.sources = {}
        for name, parameter in self.model_of(tagged).named_parameters(remove_duplicate=False):
            values = self.torch.unique(parameter.detach()).tolist()
            self.sources[name] = tuple(self.names[int(v) - 1] for v in values
                                       if v == int(v) and 1 <= v <= len(self.names))
        self.model = self.model_of(self.full)
        self.modules = [f"model.layers.{layer}.{child}" for layer in self.layers
                        for child, module in self.model.get_submodule(
                            f"model.layers.{layer}").named_children()
                        if child != "shared_head" and any(True for _ in module.parameters())]
        self.modules += [f"model.layers.{layer}.shared_head.{part}" for layer in self.layers
                         for part in ("norm", "head")]
        self.captured = self._capture()
        with self.torch.no_grad():
            self.logits = self.model(**self.inputs, use_cache=False).logits

    def model_of(self, tensors: dict[str, np.ndarray]) -> Any:
        """The MTP layers made of these on-disk tensors (the rest: zeros): each block,
        embedding, norm and head loaded by transformers as a one-layer model's."""
        from safetensors.torch import save_file

        torch = self.torch
        hosts = []
        for layer in self.layers:
            self.count += 1
            folder = self.work / f"mtp-{self.count}"
            folder.mkdir()
            _write_config(folder, _host_config(self.config))
            back = {new: old for old, new in _host_names(layer).items()}
            disk = {}
            for name in self.names:
                old = _renamed(name, back)
                if old is None:
                    continue
                disk[old] = torch.from_numpy(np.ascontiguousarray(tensors[name])) \
                    if name in tensors else torch.zeros(self.shapes[name])
            save_file(disk, str(folder / "model.safetensors"), metadata={"format": "pt"})
            host = load_model(folder)
            shutil.rmtree(folder)
            glue = {part: torch.from_numpy(np.ascontiguousarray(tensors[name]))
                    if name in tensors else torch.zeros(self.shapes[name])
                    for part in ("enorm", "hnorm", "eh_proj")
                    for name in [f"model.layers.{layer}.{part}.weight"]}
            hosts.append((layer, host, glue))
        return _wired(torch, hosts)


def _final_norm(model: Any) -> str:
    """The main model's final norm (its input: the last decoder layer's hidden state)."""
    return next(name for name in ("model.norm", "model.language_model.norm")
                if _has(model, name))


def _has(model: Any, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _write_config(folder: Path, config: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))


def _wired(torch: Any, hosts: list[tuple[int, Any, dict[str, Any]]]) -> Any:
    """A module holding each MTP layer under DeepSeek's names (`model.layers.{N}.self_attn`,
    `.enorm`, `.shared_head.head`, ...) whose forward is DeepSeek's MTP: for layer k, the
    previous hidden state (the main model's, then layer k-1's block output) combined with
    the embedding of the token k + 1 ahead; its `logits` stacked over the layers."""
    nn = torch.nn
    model, blocks = nn.Module(), {}
    model.model = nn.Module()
    model.model.layers = nn.ModuleDict()
    for layer, host, glue in hosts:
        mine = nn.Module()
        for name, child in host.model.layers[0].named_children():
            mine.add_module(name, child)
        mine.embed_tokens = host.model.embed_tokens
        width, norm = glue["enorm"].shape[0], host.model.norm
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        mine.enorm, mine.hnorm = type(norm)(width, eps=eps), type(norm)(width, eps=eps)
        mine.eh_proj = nn.Linear(2 * width, width, bias=False)
        with torch.no_grad():
            for part in ("enorm", "hnorm", "eh_proj"):
                getattr(mine, part).weight.copy_(glue[part])
        mine.shared_head = nn.Module()
        mine.shared_head.norm, mine.shared_head.head = norm, host.lm_head
        model.model.layers[str(layer)] = mine
        blocks[str(layer)] = host  # not a child: its modules are the layer's

    def forward(input_ids: Any, hidden: Any, use_cache: bool = False) -> Any:
        logits = []
        for step, (key, layer) in enumerate(model.model.layers.items()):
            ids = torch.roll(input_ids, -step, dims=-1)
            x = layer.eh_proj(torch.cat([layer.enorm(layer.embed_tokens(ids)),
                                         layer.hnorm(hidden)], dim=-1))
            host = blocks[key]
            block: list[Any] = []
            handle = host.model.layers[0].register_forward_hook(
                lambda _, args, output, block=block: block.append(first_tensor(output)))
            try:
                out = host(inputs_embeds=x, use_cache=use_cache)
            finally:
                handle.remove()
            hidden = block[0]
            logits.append(out.logits)
        return SimpleNamespace(logits=torch.stack(logits))

    model.forward = forward
    model.train(False)
    return model
