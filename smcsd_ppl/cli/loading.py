"""Loading the models that the ``models`` options name, saying on stderr what was loaded."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import pathlib
import warnings

from .util import check_threads, err, status


def set_threads(args: argparse.Namespace) -> None:
    """Apply ``--threads`` (torch's own count when unset) and silence the hub's download bars."""
    from transformers.utils import logging as hf_logging

    from ..models import threads

    hf_logging.disable_progress_bar()  # our own bar is enough
    check_threads(args.threads)
    threads.set_threads(args.threads)


def load_target(args: argparse.Namespace):
    """The target model alone (``smcsd distill`` has no draft yet)."""
    from ..models import load_model

    if args.backend != "hf":
        raise ValueError(
            f"--backend {args.backend}: this command runs the target in PyTorch (use --backend hf)"
        )
    from ..engine.worker import torch_thread
    from ..models.loading import dtype_name

    set_threads(args)
    with status(f"loading the target on {args.device} ({dtype_name(args.dtype, args.device)})"):
        target = torch_thread().run(lambda: load_model(args.target, device=args.device, dtype=args.dtype))
    err(f"target: {target.name} [{target.source}]")
    return target


def pair_options(args: argparse.Namespace) -> dict:
    """``SMCSD.load``'s arguments from the ``models`` options (checked)."""
    if args.tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {args.tensor_parallel}")
    if args.tensor_parallel > 1 and args.backend != "vllm":
        raise ValueError("--tensor-parallel needs --backend vllm")
    return {
        "target": args.target,
        "draft": args.draft,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "chat": not args.no_chat,
        "backend": args.backend,
        "vllm_options": {"tensor_parallel_size": args.tensor_parallel} if args.tensor_parallel > 1 else {},
        "draft_record": draft_record(getattr(args, "draft_record", "shipped")),
        "forward": args.forward,
        "deterministic": args.deterministic,
    }


def check_before_loading(args: argparse.Namespace, prompts: list[str], config, uses_draft: bool) -> None:
    """Refuse, before any weights load, a target that cannot be found or a prompt past its context.

    The tokenizer and the config decide both; the pair's own check after loading stays (it
    knows the draft's context too).
    """
    if args.backend != "hf":
        return
    from transformers import AutoConfig, AutoTokenizer

    from ..models.loading import local_files
    from ..text import encode_prompt

    files = local_files(args.target)
    if files is None:  # only the hub has it: loading fetches it
        return
    context = getattr(AutoConfig.from_pretrained(files), "max_position_embeddings", None)
    if context is None:
        return
    tokenizer = AutoTokenizer.from_pretrained(files)
    extra = config.block_size + 1 if uses_draft else -1  # a drafted block past the budget, then the bonus
    for prompt in prompts:
        length = len(encode_prompt(tokenizer, prompt, chat=not args.no_chat))
        if length + config.max_new_tokens + extra > context:
            raise ValueError(
                f"the prompt is {length} tokens: with max_new_tokens ({config.max_new_tokens}) it "
                f"exceeds the target's context of {context} tokens"
            )


def draft_record(spec: str):
    """``--draft-record``: None for the draft's shipped record, an empty record, or one read from a file."""
    from ..config import DraftRecord

    if spec == "shipped":
        return None
    if spec == "none":
        return DraftRecord()
    try:
        return DraftRecord.from_json(json.loads(pathlib.Path(spec).read_text(encoding="utf-8")))
    except (OSError, ValueError) as err:  # a JSON syntax error is a ValueError too
        raise ValueError(
            f"--draft-record {spec!r}: {err} (give shipped, none, or a record's JSON file)"
        ) from None


@contextlib.contextmanager
def load_notes():
    """Say a busy CPU during a load as the command line says things (one note), other warnings as usual."""
    from ..models.threads import BusyCPUWarning

    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always", BusyCPUWarning)
        yield
    for note in notes:
        if issubclass(note.category, BusyCPUWarning):
            err(f"note: {str(note.message).split('; pass threads=N')[0]}; --threads N to choose")
        else:
            warnings.showwarning(note.message, note.category, note.filename, note.lineno)


def load_pair(args: argparse.Namespace, *, torch_models: bool = False):
    """The target and draft as an ``SMCSD``, with a warning when the draft is a weak layer slice.

    ``torch_models``: the command runs the models in PyTorch besides the backends, which a vLLM
    pair does not build; ``--backend vllm`` is refused in one line.
    """
    from ..api import SMCSD

    if torch_models and args.backend != "hf":
        raise ValueError(
            f"--backend {args.backend}: this command runs the models in PyTorch (use --backend hf)"
        )
    set_threads(args)
    options = pair_options(args)
    if args.backend == "vllm":  # its start-up notes run to hundreds of lines; errors still show
        logging.getLogger("vllm").setLevel(logging.ERROR)
    from ..models.loading import dtype_name

    where = f"{args.device} ({dtype_name(args.dtype, args.device)})" + (
        ", on vLLM" if args.backend == "vllm" else ""
    )
    with status(f"loading models on {where}"), load_notes():
        pair = SMCSD.load(**options)
    err(f"target: {pair.target.name} [{pair.target.source}]")
    err(f"draft:  {pair.draft.name} [{pair.draft.source}]")
    if pair.draft.is_slice:
        err(
            "note: a layer slice of the target is a WEAK draft (it agrees with the target on few tokens); "
            "expect low ESS and outputs closer to the draft than to the target. Pass --draft, or make one "
            "with `smcsd distill`."
        )
    return pair
