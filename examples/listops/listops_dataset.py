"""TFDS builder of Long Range Arena ListOps, generated locally (no download).

import tensorflow_datasets as tfds
from examples.listops.listops_dataset import ListOps, ListOpsConfig

builder = ListOps(config="lra", data_dir="~/tensorflow_datasets")  # LRA: lengths 500-2000
builder.download_and_prepare()
train = builder.as_dataset(split="train")

# Any other scale: a custom config.
config = ListOpsConfig(name="tiny", min_length=16, max_length=128, num_train=2000,
                       num_validation=200, num_test=200, seed=0)
builder = ListOps(config=config, data_dir="/tmp/tfds")
"""

import dataclasses

import numpy as np
import tensorflow_datasets as tfds

from examples.listops import generator

_DESCRIPTION = """\
Long Range Arena ListOps (Tay et al. 2021; Nangia & Bowman 2018): nested
MIN/MAX/MED/SM (sum mod 10) expressions over digits, label = value (10 classes).
Generated locally with LRA's tree rules (max depth 10, max 10 arguments);
`source` holds the space-separated tokens without LRA's parentheses.
"""

_CITATION = """\
@inproceedings{tay2021long,
  title={Long Range Arena: A Benchmark for Efficient Transformers},
  author={Tay, Yi and Dehghani, Mostafa and Abnar, Samira and Shen, Yikang and Bahri, Dara and
          Pham, Philip and Rao, Jinfeng and Yang, Liu and Ruder, Sebastian and Metzler, Donald},
  booktitle={ICLR},
  year={2021}
}
"""


@dataclasses.dataclass(eq=False)
class ListOpsConfig(tfds.core.BuilderConfig):
    """Scale of a generated ListOps dataset.

    Args:
        min_length, max_length: inclusive bounds of the token length (LRA: 500, 2000).
        max_depth, max_args: tree limits (LRA: 10, 10).
        num_train, num_validation, num_test: examples per split (LRA: 96000, 2000, 2000).
        seed: seed of the generator; the same config gives the same examples.
    """

    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10
    num_train: int = 96000
    num_validation: int = 2000
    num_test: int = 2000
    seed: int = 0


class ListOps(tfds.core.GeneratorBasedBuilder):
    """ListOps generated offline; configs ``lra`` (LRA's scale) and ``small`` (CPU scale)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Local generation with LRA's rules."}
    BUILDER_CONFIGS = [
        ListOpsConfig(name="lra", description="LRA scale: lengths 500-2000, 96k/2k/2k examples."),
        ListOpsConfig(
            name="small",
            description="CPU scale: lengths 16-256, 4k/500/500 examples.",
            min_length=16,
            max_length=256,
            num_train=4000,
            num_validation=500,
            num_test=500,
        ),
    ]
    DEFAULT_CONFIG_NAME = "small"

    def _info(self):
        # DatasetInfo(builder=self, ...) directly: dataset_info_from_configs looks
        # for metadata files beside the module, which this example does not ship.
        return tfds.core.DatasetInfo(
            builder=self,
            description=_DESCRIPTION,
            features=tfds.features.FeaturesDict(
                {
                    "source": tfds.features.Text(),
                    "label": tfds.features.ClassLabel(num_classes=generator.NUM_CLASSES),
                    "length": tfds.features.Scalar(dtype=np.int32),
                }
            ),
            supervised_keys=("source", "label"),
            citation=_CITATION,
        )

    def _split_generators(self, dl_manager):
        c = self.builder_config
        splits = generator.generate(
            {"train": c.num_train, "validation": c.num_validation, "test": c.num_test},
            seed=c.seed,
            min_length=c.min_length,
            max_length=c.max_length,
            max_depth=c.max_depth,
            max_args=c.max_args,
        )
        return {name: self._generate_examples(examples) for name, examples in splits.items()}

    def _generate_examples(self, examples):
        for i, (source, label) in enumerate(examples):
            yield i, {"source": source, "label": label, "length": len(source.split())}
