"""Every vision-language family record (tuneloop/vision_families/, one file a family) reaches the tables derived from
it, and a family tuneloop trains has a tiny twin (vision_family_models.TWINS) that its record describes: the model
type, the vision modules and projector by name, a tower the plan counts. A record added without what it needs, or
a family file whose facts do not fit its model, fails here."""

from __future__ import annotations

import pytest

from tuneloop.vision_families import UNTRAINED_FAMILIES, VISION_FAMILIES, family_named_by, packing_families

TRAINED = list(VISION_FAMILIES.values())
NOT_COUNTED = {"mllama"}  # towers the plan does not count yet (it says so: VisionWeights.why_not)
CHECKED = {"datasets": [{"path": "x", "type": "chat_template"}], "processor_type": "AutoProcessor"}


@pytest.mark.parametrize("family", TRAINED, ids=lambda family: family.name)
def test_a_trained_familys_record_is_in_every_table_derived_from_it(family):
    from tuneloop.config import axolotl, vision_names
    from tuneloop.config.load import config_from_dict
    from tuneloop.data import images
    from tuneloop.plan.flops import PROJECTOR_PARTS

    assert family.name in vision_names.TRAINED_VISION_TYPES and images.VISION_FAMILIES[family.name] is family
    assert family.words in vision_names.TRAINED_VISION_WORDS and family.words in axolotl.FEATURES["multimodal"][1]
    assert (family.name in packing_families().split(", ")) == family.packs
    assert family.projector_parts and set(family.projector_parts) <= set(PROJECTOR_PARTS)
    assert family.shrink is None or family.shrink.format(pixels=784)  # (check_images_fit's call)
    assert (family.tower_shape is None) == (family.name in NOT_COUNTED)
    assert family.hub_examples or not family.hub_ids  # (patterns come with the names they are for)
    for hub_id in family.hub_examples:  # named by its hub id, and accepted by `check`
        assert family_named_by(hub_id) is family, hub_id
        assert config_from_dict({**CHECKED, "base_model": hub_id}).processor_type == "AutoProcessor"


@pytest.mark.parametrize("family", list(UNTRAINED_FAMILIES.values()), ids=lambda family: family.name)
def test_a_family_tuneloop_does_not_train_is_refused_by_check_naming_it(family):
    import re

    from tuneloop.config import axolotl
    from tuneloop.config.load import config_from_dict
    from tuneloop.errors import UserError

    assert family.name not in VISION_FAMILIES and family.hub_examples
    assert not family.needs or family.words in axolotl.FEATURES["multimodal"][1]
    for hub_id in family.hub_examples:
        assert family_named_by(hub_id) is family, hub_id
        with pytest.raises(UserError, match=f"is a {re.escape(family.words)} vision-language model .*"
                                            + re.escape(family.why_not)):
            config_from_dict({**CHECKED, "base_model": hub_id})


def test_every_trained_family_has_a_tiny_twin():
    from vision_family_models import TWINS

    assert set(TWINS) == set(VISION_FAMILIES)


@pytest.mark.parametrize("family", TRAINED, ids=lambda family: family.name)
def test_the_record_describes_its_tiny_twin(tmp_path, family):
    """The twin's model type is the record's, its vision modules and projector parts are module names of the model
    (built on the meta device), and the plan counts its tower's positions from the record's shape."""
    import torch
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText
    from vision_family_models import TWINS

    from tuneloop.plan.flops import image_flops, vision_weights

    folder = TWINS[family.name](tmp_path / family.name)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == family.name
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    names = {part for name, _ in model.named_modules() for part in name.split(".")}
    assert set(family.vision_modules) <= names and set(family.projector_parts) <= names
    vision = vision_weights(model, config, family, AutoImageProcessor.from_pretrained(folder))
    if family.name in NOT_COUNTED:
        assert vision.why_not
        return
    assert vision.why_not is None and vision.layers and sum(vision.weights("projector"))
    assert image_flops(vision, 4)[0] > 0
