"""The ZMQ client takes OpenAI-style image parts in chat messages and sends them as the engine's parts."""

from __future__ import annotations

import base64

from client.common import make_request
from protocol.chat import ImagePart, TextPart


def test_image_url_data_uris_and_raw_images_become_parts() -> None:
    uri = "data:image/png;base64," + base64.b64encode(b"\x89PNG...").decode()
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": uri}},
        {"type": "image", "data": b"GIF89a"},
        {"type": "image_url", "image_url": {"url": "file:///srv/a.png"}},
    ]
    req = make_request(None, False, {"messages": [{"role": "user", "content": content}]})
    assert req.messages is not None
    message = req.messages[0]
    assert message.content is None
    images = [ImagePart(data=b"\x89PNG..."), ImagePart(data=b"GIF89a"), ImagePart(path="/srv/a.png")]
    assert message.parts == [TextPart(text="What is this?"), *images]
    plain = make_request(None, False, {"messages": [{"role": "user", "content": "hi"}]})
    assert (
        plain.messages is not None and plain.messages[0].content == "hi" and plain.messages[0].parts is None
    )
