"""What a launched Python program is, from its path: a decoder-only training entry point, or another
model family, inference or a tool. heteroflow refuses everything but the first, naming what it is."""

from __future__ import annotations

import posixpath
import re

_BY_NAME = {
    "pretrain_bert.py": "BERT (bidirectional encoder, masked-LM objective)",
    "pretrain_t5.py": "T5 (encoder-decoder)",
    "pretrain_mamba.py": "Mamba / hybrid state-space model",
    "pretrain_hybrid.py": "hybrid Mamba / attention model",
    "pretrain_retro.py": "Retro (retrieval-augmented decoder)",
    "pretrain_vlm.py": "multimodal vision-language model (VLM)",
    "pretrain_ict.py": "ICT retriever (BERT encoders)",
    "pretrain_vision_classify.py": "vision Transformer",
    "pretrain_vision_dino.py": "vision Transformer",
    "pretrain_vision_inpaint.py": "vision Transformer",
}
_BY_DIRECTORY = (
    ("multimodal", "multimodal vision-language model (VLM)"),
    ("mimo", "multimodal vision-language model (VLM, MIMO)"),
    ("llava", "multimodal vision-language model (VLM)"),
)
_INFERENCE = re.compile(r"(text_generation|inference|generat|_server|_cli)\w*\.py$")
_TOOLS = (
    (re.compile(r"(preprocess|prepare|tokeniz)\w*\.py$"), "data preprocessing"),
    (re.compile(r"(convert|converter|export|combine|checkpoint|merge|split)\w*\.py$"), "checkpoint conversion"),
    (re.compile(r"(quantize|prune|distill)\w*\.py$"), "model optimization (quantization / pruning)"),
    (re.compile(r"(mmlu|eval|validate|evaluate)\w*\.py$"), "evaluation"),
)


_NEMO_FAMILIES = {
    "bert": "BERT (bidirectional encoder, masked-LM objective)", "t5": "T5 (encoder-decoder)",
    "mt5": "mT5 (encoder-decoder)", "retro": "Retro (retrieval-augmented decoder)",
    "clip": "CLIP (vision-text contrastive model)", "vit": "vision Transformer",
    "neva": "multimodal vision-language model (VLM, NeVA)", "video_neva": "multimodal video-language model (VLM)",
    "stable_diffusion": "diffusion image model (Stable Diffusion)", "sdxl": "diffusion image model (SDXL)",
    "imagen": "diffusion image model (Imagen)", "controlnet": "diffusion image model (ControlNet)",
    "dreambooth": "diffusion image model (DreamBooth)", "instruct_pix2pix": "diffusion image model (InstructPix2Pix)",
    "nerf": "NeRF 3D generation (DreamFusion)",
}


def nemo_family(path: str) -> str | None:
    """The model family of a NeMo-Framework-Launcher training YAML (`conf/training/<family>/X.yaml`) when
    it is not a decoder-only GPT, else None."""
    directories = path.replace("\\", "/").split("/")[:-1]
    if "training" not in directories:
        return None  # not laid out like the launcher's conf/training/<family>/: the directory tells nothing
    directories = directories[len(directories) - directories[::-1].index("training"):]
    if "tp_overlap" in directories:
        return ("not a training configuration: NeMo's tp_overlap files hold Transformer Engine userbuffer "
                "settings for tensor-parallel overlap")
    for family in reversed(directories):
        if family in _NEMO_FAMILIES:
            return f"{_NEMO_FAMILIES[family]}: NeMo's {family} training configuration is not a decoder-only GPT model"
    return None


def program_family(program: str) -> str | None:
    """Why `program` (a path as the script writes it) is not a GPT training run, or None when it is one."""
    name = posixpath.basename(program)
    if name in _BY_NAME:
        return f"{_BY_NAME[name]}: the entry point {name} does not train a decoder-only GPT model"
    if _INFERENCE.search(name):
        return f"inference: {program} generates text from a trained model; it is not a training run"
    for pattern, kind in _TOOLS:
        if pattern.search(name):
            return f"{kind}: {program} is a tool, not a training run"
    parts = program.replace("\\", "/").split("/")[:-1]
    for directory, family in _BY_DIRECTORY:
        if directory in parts:
            return f"{family}: {program} trains a model with non-text encoders, not a decoder-only GPT"
    return None
