"""The rendering station: text to token ids. A row becomes the prompt text and its ids
(renderer.py, the interface: Renderer) through the model's chat template (chat.py) and tokenizer
(tokenizer.py); a row's images become the model's placeholders and pixels (images.py). fit.py is
the start-up check that the first prompts leave room for a completion. It takes rows from the
prompts station (orchestrator/prompts/) and knows nothing of rollouts, servers or rewards."""

# The station's interface, as the other stations use it.
from orchestrator.rendering.chat import ChatTemplate, row_messages
from orchestrator.rendering.fit import (Opening, dataset_fits, environment_fits, error_line, measure, sample,
                                        tokenizer_of)
from orchestrator.rendering.images import (ImageError, ImagePrompt, check_expanded, decode, expand, expand_placeholders,
                                           has_images, image_parts, image_support, images_at_start_up, png,
                                           read_source, render_image_prompt, request_fields, template_messages)
from orchestrator.rendering.renderer import Renderer, stop_token_ids
from orchestrator.rendering.tokenizer import load_tokenizer

__all__ = ["ChatTemplate", "check_expanded", "dataset_fits", "decode", "environment_fits", "error_line",
           "expand", "expand_placeholders", "has_images", "image_parts", "image_support", "ImageError", "ImagePrompt",
           "images_at_start_up", "load_tokenizer", "measure", "Opening", "png", "read_source", "Renderer",
           "render_image_prompt", "request_fields", "row_messages", "sample", "stop_token_ids", "template_messages",
           "tokenizer_of"]
