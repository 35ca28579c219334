"""Course tooling: problem sizes, notebook helpers, exercise generation, checks and grading.

Kept apart from the reference implementation (picotron/), which never imports it.

Every notebook takes its problem sizes from `settings` so they are small on a laptop CPU
(a chapter runs in about a minute) and larger on GPUs, never from environment variables:

    from picotron_course import settings
    run(step, world_size=settings.world_size, timeout=settings.timeout)

The assignments (solutions/ -> exercises/) use the rest of this package:
`exercises` generates exercises from solutions and strips notebook outputs, `checks_*` hold
the check each exercise cell calls, `grade` scores a learner's notebook or a class's folder of
them, `site` renders the executed chapters as HTML; the command line is
`python -m picotron_course generate | check | strip | grade | site` (see __main__.py). `notebook`
holds the figure and timing helpers the chapters share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Settings:
    """Problem sizes for the notebooks. `on_gpu` picks the larger ones."""

    on_gpu: bool
    world_size: int = 4            # ranks a chapter runs on (8 for the 5D chapter)
    model_preset: str = "tiny"     # model used by the training demos
    train_steps: int = 30          # steps of the training demos
    max_message_mib: float = 16.0  # largest message of a bandwidth curve
    timeout: float = 120.0         # seconds before `run` gives up on the ranks
    check_timeout: float = 60.0    # seconds before an assignment's check gives up (a ring that deadlocks)

    @classmethod
    def detect(cls) -> "Settings":
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            return cls(on_gpu=True, world_size=min(torch.cuda.device_count(), 8), model_preset="smollm-135m",
                       train_steps=100, max_message_mib=1024.0)
        return cls(on_gpu=False)


settings = Settings.detect()
