"""Families tuneloop knows by name and does not train: `check` refuses them naming the family (and why, where it is
more than "not yet"), so that "accepted by check" means what it says."""

from tuneloop.vision_families._record import UntrainedFamily

_NO_PIL_TWIN = ("is in transformers only as a torchvision one, with no PIL twin, and tuneloop reads images without "
                "torchvision (not one of its dependencies)")

FAMILIES = (
    # (timm builds MobileNetV5 on torchvision: it installs torchvision with it)
    UntrainedFamily(name="gemma3n", words="Gemma 3n", hub_ids=(r"gemma-3n",), hub_examples=("google/gemma-3n-E4B-it",),
                    needs="timm",
                    why_not="Gemma 3n's vision tower is timm's MobileNetV5, and timm needs torchvision, which tuneloop "
                            "does not depend on (its audio side is not trained either)"),
    # (transformers' gemma4_unified: google/gemma-4-12B-it)
    UntrainedFamily(name="gemma4_unified", words="Gemma 4 unified", hub_ids=(r"gemma-4-12b",),
                    hub_examples=("google/gemma-4-12B-it",), needs="torchvision",
                    why_not=f"the image processor of Gemma 4 unified (gemma-4-12B) {_NO_PIL_TWIN}"),
    UntrainedFamily(name="llama4", words="Llama 4", hub_ids=(r"llama-4",),
                    hub_examples=("meta-llama/Llama-4-Scout-17B-16E-Instruct",), needs="torchvision",
                    why_not=f"Llama 4's image processor (its tiles and their image text) {_NO_PIL_TWIN}"),
    UntrainedFamily(name="lfm2_vl", words="LFM2-VL", hub_ids=(r"lfm2-vl",), hub_examples=("LiquidAI/LFM2-VL-1.6B",),
                    needs="torchvision", why_not=f"LFM2-VL's image processor {_NO_PIL_TWIN}"),
    UntrainedFamily(name="idefics2", words="Idefics / Idefics2", hub_ids=(r"idefics",),
                    hub_examples=("HuggingFaceM4/idefics2-8b",)),
    UntrainedFamily(name="voxtral", words="Voxtral (audio)", hub_ids=(r"voxtral",),
                    hub_examples=("mistralai/Voxtral-Mini-3B-2507",)),
)
