"""Pure bytes <-> objects for the hydra RPC protocol. Importable without llama_cpp."""

from .errors import BadMagic, ErrorCode, ProtocolError, Status
from .frames import (
    DecodeFrame,
    encode_decode_frame_simple,
    encode_decode_frame_v3,
    encode_v3_raw,
    merged_generation,
    parse_decode_frame,
)
from .hashing import check_tag, parse_tag, xxh3_64, xxh3_tag
from .kvblob import Checkpoint, KvBlob, encode_blob_head, encode_kv_blob, parse_kv_blob
from .protocol import (
    MAGIC,
    Op,
    RequestHeader,
    ResponseHeader,
    encode_request,
    encode_response,
    parse_request_header,
    parse_response_header,
)

__all__ = [
    "MAGIC",
    "BadMagic",
    "Checkpoint",
    "DecodeFrame",
    "ErrorCode",
    "KvBlob",
    "Op",
    "ProtocolError",
    "RequestHeader",
    "ResponseHeader",
    "Status",
    "check_tag",
    "encode_blob_head",
    "encode_decode_frame_simple",
    "encode_decode_frame_v3",
    "encode_kv_blob",
    "encode_request",
    "encode_response",
    "encode_v3_raw",
    "merged_generation",
    "parse_decode_frame",
    "parse_kv_blob",
    "parse_request_header",
    "parse_response_header",
    "parse_tag",
    "xxh3_64",
    "xxh3_tag",
]
