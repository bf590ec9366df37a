"""The client side of the Generate stream protocol: `start`, at most one `cancel`, then the end."""

from __future__ import annotations

from chatmesh.router.v1 import router_pb2
from chatmesh.streams import Outbox

START = router_pb2.GenerateRequest(start=router_pb2.GenerateStart(request_id="r"))
CANCEL = router_pb2.GenerateRequest(cancel=router_pb2.GenerateCancel())


async def sent(outbox: Outbox) -> list[str]:
    return [frame.WhichOneof("kind") async for frame in outbox.frames()]


async def test_an_outbox_sends_start_then_at_most_one_cancel_then_ends():
    outbox = Outbox(CANCEL)
    outbox.start(START)
    outbox.cancel()
    outbox.cancel()
    outbox.close()
    outbox.close()
    assert await sent(outbox) == ["start", "cancel"]


async def test_no_cancel_goes_out_after_the_request_side_is_closed():
    outbox = Outbox(CANCEL)
    outbox.start(START)
    outbox.close()
    outbox.cancel()
    assert await sent(outbox) == ["start"]
