"""A stand-in ComfyUI host for CI tests (no ComfyUI installed).

``install()`` puts fake ``comfy_api.latest`` (io / ui / ComfyExtension), ``comfy.utils`` (a ProgressBar that
records its updates), ``comfy.model_management``, ``folder_paths`` and ``server`` (a PromptServer whose
``send_sync`` records events) into ``sys.modules`` and returns a ``StubHost`` that holds the records.
``uninstall()`` removes every module it added. The io part implements only what the pack uses, and the
``/object_info`` shape (``node_info``) the same way the host's V1 view does: inputs as ``(type, options)``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

STUB_MODULES = (
    "comfy_api",
    "comfy_api.latest",
    "comfy",
    "comfy.utils",
    "comfy.model_management",
    "comfy.model_patcher",
    "folder_paths",
    "server",
)


# ------------------------------------------------------------------------------------------------ io
def _prune(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


class NumberDisplay(str, Enum):
    number = "number"
    slider = "slider"


class Hidden(str, Enum):
    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    dynprompt = "DYNPROMPT"


class _Input:
    io_type = "*"

    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None,
                 force_input=None, **extra):
        self.id, self.display_name, self.optional, self.tooltip = id, display_name, optional, tooltip
        self.lazy, self.default, self.force_input, self.extra = lazy, default, force_input, extra

    def options(self) -> dict:
        return _prune({"tooltip": self.tooltip, "lazy": self.lazy, "default": self.default,
                       "forceInput": self.force_input, "display_name": self.display_name})

    def type_slot(self):
        return self.io_type


class _Output:
    io_type = "*"

    def __init__(self, id=None, display_name=None, tooltip=None, is_output_list=False):
        self.id, self.display_name, self.tooltip, self.is_output_list = id, display_name, tooltip, is_output_list


def _make_type(io_type: str, input_cls=_Input):
    inp = type("Input", (input_cls,), {"io_type": io_type})
    out = type("Output", (_Output,), {"io_type": io_type})
    return type(io_type, (), {"io_type": io_type, "Input": inp, "Output": out})


class _NumberInput(_Input):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None, min=None,
                 max=None, step=None, round=None, display_mode=None, control_after_generate=None,
                 force_input=None, socketless=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, force_input)
        self.min, self.max, self.step, self.round = min, max, step, round
        self.display_mode, self.control_after_generate = display_mode, control_after_generate

    def options(self) -> dict:
        display = self.display_mode.value if isinstance(self.display_mode, Enum) else self.display_mode
        return super().options() | _prune({"min": self.min, "max": self.max, "step": self.step, "round": self.round,
                                           "display": display, "control_after_generate": self.control_after_generate})


class _StringInput(_Input):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, multiline=False,
                 placeholder=None, default=None, dynamic_prompts=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, force_input)
        self.multiline, self.placeholder = multiline, placeholder

    def options(self) -> dict:
        return super().options() | _prune({"multiline": self.multiline, "placeholder": self.placeholder})


class _ComboInput(_Input):
    def __init__(self, id, options=None, display_name=None, optional=False, tooltip=None, lazy=None, default=None,
                 control_after_generate=None, **extra):
        super().__init__(id, display_name, optional, tooltip, lazy, default)
        self.choices = list(options or [])
        self.control_after_generate = control_after_generate

    def options(self) -> dict:
        return super().options() | _prune({"options": self.choices, "control_after_generate": self.control_after_generate})

    def type_slot(self):
        return self.choices


class _BoolInput(_Input):
    def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None, default=None,
                 label_on=None, label_off=None, socketless=None, force_input=None):
        super().__init__(id, display_name, optional, tooltip, lazy, default, force_input)


@dataclass
class Schema:
    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    is_output_node: bool = False
    is_deprecated: bool = False
    is_experimental: bool = False
    not_idempotent: bool = False
    enable_expand: bool = False

    def validate(self) -> None:
        ids = [i.id for i in self.inputs] + [o.id for o in self.outputs if o.id]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate input/output ids in {self.node_id}: {ids}")


class NodeOutput:
    def __init__(self, *args, ui=None, expand=None, block_execution=None):
        self.args, self.ui, self.expand, self.block_execution = args, ui, expand, block_execution

    @property
    def result(self):
        return self.args if self.args else None

    def __getitem__(self, index):
        return self.args[index]


@dataclass
class HiddenHolder:
    unique_id: str | None = None
    prompt: Any = None
    extra_pnginfo: Any = None
    dynprompt: Any = None


class ComfyNode:
    hidden: HiddenHolder | None = None

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs):
        raise NotImplementedError


def Custom(io_type: str):  # noqa: N802 - mirrors the host's API
    return _make_type(io_type)


def node_info(cls) -> dict:
    """The ``/object_info`` entry of a node class (V1 view), from its schema."""
    schema = cls.define_schema()
    schema.validate()
    required, optional, hidden = {}, {}, {}
    for inp in schema.inputs:
        (optional if inp.optional else required)[inp.id] = [inp.type_slot(), inp.options()]
    for h in schema.hidden or []:
        hidden[h.name] = [h.value]
    inputs = {"required": required}
    if optional:
        inputs["optional"] = optional
    if hidden:
        inputs["hidden"] = hidden
    return {
        "input": inputs,
        "input_order": {k: list(v) for k, v in inputs.items()},
        "output": [o.io_type for o in schema.outputs],
        "output_name": [o.display_name or o.io_type for o in schema.outputs],
        "output_tooltips": [o.tooltip for o in schema.outputs],
        "output_is_list": [o.is_output_list for o in schema.outputs],
        "name": schema.node_id,
        "display_name": schema.display_name,
        "description": schema.description,
        "category": schema.category,
        "output_node": schema.is_output_node,
        "python_module": "custom_nodes.sdvg",
    }


def _io_module() -> types.ModuleType:
    io = types.ModuleType("comfy_api.latest.io")
    io.Schema, io.NodeOutput, io.ComfyNode, io.Custom = Schema, NodeOutput, ComfyNode, Custom
    io.NumberDisplay, io.Hidden, io.HiddenHolder = NumberDisplay, Hidden, HiddenHolder
    io.Int = _make_type("INT", _NumberInput)
    io.Float = _make_type("FLOAT", _NumberInput)
    io.String = _make_type("STRING", _StringInput)
    io.Boolean = _make_type("BOOLEAN", _BoolInput)
    io.Combo = _make_type("COMBO", _ComboInput)
    for name, io_type in {"Image": "IMAGE", "Latent": "LATENT", "Conditioning": "CONDITIONING", "Mask": "MASK",
                          "Model": "MODEL", "Clip": "CLIP", "Vae": "VAE", "Video": "VIDEO"}.items():
        setattr(io, name, _make_type(io_type))
    return io


class ComfyExtension:
    async def on_load(self) -> None:
        return None

    async def get_node_list(self) -> list:
        return []


# ------------------------------------------------------------------------------------------------ host services
class InterruptProcessingException(Exception):
    pass


@dataclass
class StubHost:
    models_dir: Path
    previews: list = field(default_factory=list)  # (node_id, value, total, (fmt, image, max_side))
    progress: list = field(default_factory=list)  # (node_id, value, total)
    events: list = field(default_factory=list)  # (event, data, sid)
    interrupted: bool = False
    interrupt_after_steps: int | None = None
    client_id: str = "stub-client"
    loads: list = field(default_factory=list)  # load_models_gpu calls: (patcher names, memory_required, full)

    def events_of(self, name: str) -> list[dict]:
        return [data for event, data, _sid in self.events if event == name]


def _build_modules(host: StubHost) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}

    api = types.ModuleType("comfy_api")
    api.__path__ = []  # a package
    latest = types.ModuleType("comfy_api.latest")
    latest.io = _io_module()
    latest.ui = types.ModuleType("comfy_api.latest.ui")
    latest.ComfyExtension = ComfyExtension
    api.latest = latest
    mods["comfy_api"], mods["comfy_api.latest"] = api, latest

    import torch

    mm = types.ModuleType("comfy.model_management")
    mm.InterruptProcessingException = InterruptProcessingException
    mm.intermediate_device = lambda: torch.device("cpu")
    mm.get_torch_device = lambda: torch.device("cpu")
    mm.soft_empty_cache = lambda force=False: None
    mm.free_memory = lambda memory_required, device, keep_loaded=(): None
    mm.unload_all_models = lambda: (_ for _ in ()).throw(AssertionError("the pack must not unload all models"))
    mm.unet_offload_device = mm.vae_offload_device = mm.text_encoder_offload_device = lambda: torch.device("cpu")

    def load_models_gpu(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                        force_full_load=False):
        for p in models:  # what the real one does once room is made: the whole model onto its load device
            p.model.to(p.load_device)
            p.model.device = p.load_device
        host.loads.append(([p.model.sdvg_name for p in models], memory_required, force_full_load))

    mm.load_models_gpu = load_models_gpu

    def processing_interrupted():
        return host.interrupted

    def throw_exception_if_processing_interrupted():
        if host.interrupted:
            host.interrupted = False
            raise InterruptProcessingException()

    def interrupt_current_processing(value=True):
        host.interrupted = bool(value)

    mm.processing_interrupted = processing_interrupted
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    mm.interrupt_current_processing = interrupt_current_processing

    patcher_mod = types.ModuleType("comfy.model_patcher")

    class ModelPatcher:  # the part of the real contract the pack relies on
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            self.model, self.load_device, self.offload_device, self.size = model, load_device, offload_device, size
            if getattr(model, "device", None) is None:
                model.device = offload_device

        def current_loaded_device(self):
            return self.model.device

        def model_size(self):
            return self.size or sum(t.numel() * t.element_size() for t in self.model.parameters())

        def detach(self, unpatch_all=True):
            self.model.to(self.offload_device)
            self.model.device = self.offload_device
            return self.model

    patcher_mod.ModelPatcher = ModelPatcher
    mods["comfy.model_patcher"] = patcher_mod

    utils = types.ModuleType("comfy.utils")

    class ProgressBar:
        def __init__(self, total, node_id=None):
            self.total, self.node_id, self.current = total, node_id, 0

        def update_absolute(self, value, total=None, preview=None):
            if preview is not None and not (isinstance(preview, tuple) and len(preview) == 3):
                raise TypeError("a preview must be the tuple (format, PIL image, max_size); a bare image kills the server")
            throw_exception_if_processing_interrupted()  # the real hook is a cancel point too
            if total is not None:
                self.total = total
            self.current = min(value, self.total)
            host.progress.append((self.node_id, self.current, self.total))
            if preview is not None:
                host.previews.append((self.node_id, self.current, self.total, preview))
            # the user presses Cancel once, at that update (ComfyUI's flag is set once and consumed by its check)
            if host.interrupt_after_steps is not None and len(host.progress) == host.interrupt_after_steps:
                host.interrupted = True

        def update(self, value):
            self.update_absolute(self.current + value)

    utils.ProgressBar = ProgressBar
    comfy = types.ModuleType("comfy")
    comfy.__path__ = []
    comfy.utils, comfy.model_management, comfy.model_patcher = utils, mm, patcher_mod
    mods["comfy"], mods["comfy.utils"], mods["comfy.model_management"] = comfy, utils, mm

    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(host.models_dir)
    exts = {".safetensors", ".pt", ".pth", ".ckpt", ".bin", ".sft"}
    fp.folder_names_and_paths = {
        name: ([str(host.models_dir / name)], exts)
        for name in ("diffusion_models", "text_encoders", "vae", "checkpoints", "loras")
    }

    def add_model_folder_path(name, path, is_default=False):
        if name in fp.folder_names_and_paths:
            paths = fp.folder_names_and_paths[name][0]
            if path not in paths:
                paths.insert(0, path) if is_default else paths.append(path)
        else:
            fp.folder_names_and_paths[name] = ([path], set())

    def get_folder_paths(name):
        return list(fp.folder_names_and_paths[name][0])

    def get_filename_list(name):
        paths, extensions = fp.folder_names_and_paths[name]
        found = []
        for p in paths:
            root = Path(p)
            if root.is_dir():
                found += [str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()
                          and (not extensions or f.suffix.lower() in extensions)]
        return sorted(set(found))

    def get_full_path(name, filename):
        if name not in fp.folder_names_and_paths:
            return None
        for p in fp.folder_names_and_paths[name][0]:
            f = Path(p) / filename
            if f.is_file():
                return str(f)
        return None

    fp.add_model_folder_path, fp.get_folder_paths = add_model_folder_path, get_folder_paths
    fp.get_filename_list, fp.get_full_path = get_filename_list, get_full_path
    mods["folder_paths"] = fp

    server = types.ModuleType("server")

    class PromptServer:
        instance = None

        def __init__(self):
            self.client_id = host.client_id

        def send_sync(self, event, data, sid=None):
            host.events.append((event, data, sid))

    PromptServer.instance = PromptServer()
    server.PromptServer = PromptServer
    mods["server"] = server
    return mods


_saved: dict[str, Any] = {}


def install(models_dir: Path) -> StubHost:
    """Install the stub modules (refusing to shadow a real ComfyUI already imported)."""
    if _saved:
        raise RuntimeError("stub host already installed")
    host = StubHost(models_dir=Path(models_dir))
    for name, module in _build_modules(host).items():
        _saved[name] = sys.modules.get(name)
        sys.modules[name] = module
    return host


def uninstall() -> None:
    for name, previous in _saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved.clear()
