"""Protobuf message classes for MindSpore's strategy and checkpoint schemas, built from our own
descriptors (field numbers per ``spec/strategy-format.md`` §1 and ``spec/checkpoint-format.md`` §1).

The schemas are declared here as data and registered in a private descriptor pool, so no generated
``_pb2`` code (tied to one protobuf release) is needed and the names cannot clash with MindSpore's
own registrations when both are imported in one process. The equivalent ``.proto`` texts ship
beside this module for reference.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_OPT, _REQ, _REP = _F.LABEL_OPTIONAL, _F.LABEL_REQUIRED, _F.LABEL_REPEATED
_TYPES = {
    "uint32": _F.TYPE_UINT32,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
}

# message name -> [(field name, number, label, type or message name)]
STRATEGY_MESSAGES: dict[str, list[tuple[str, int, int, str]]] = {
    "ParallelStrategy": [("dim", 1, _REP, "uint32")],
    "ParallelStrategys": [("stage", 1, _REQ, "uint32"), ("parallel_strategy", 2, _REP, ".ParallelStrategy")],
    "ParallelStrategyItem": [("node_name", 1, _REQ, "string"), ("parallel_strategys", 2, _REQ, ".ParallelStrategys")],
    "DevMatrix": [("dim", 1, _REP, "uint32")],
    "TensorMap": [("dim", 1, _REP, "int32")],
    "ParamSplitShape": [("dim", 1, _REP, "int64")],
    "IndicesOffset": [("dim", 1, _REP, "int64")],
    "ParallelLayouts": [
        ("dev_matrix", 1, _REP, ".DevMatrix"),
        ("tensor_map", 2, _REP, ".TensorMap"),
        ("param_split_shape", 3, _REP, ".ParamSplitShape"),
        ("indices_offset", 4, _REP, ".IndicesOffset"),
        ("field", 5, _REQ, "int32"),
        ("opt_weight_shard_step", 6, _REQ, "int32"),
        ("opt_weight_shard_size", 7, _REQ, "int32"),
    ],
    "ParallelLayoutItem": [("param_name", 1, _REQ, "string"), ("parallel_layouts", 2, _REQ, ".ParallelLayouts")],
    "ParallelGroupRanks": [("dim", 1, _REP, "uint32")],
    "ParallelGroupItem": [("group_name", 1, _REQ, "string"), ("parallel_group_ranks", 2, _REQ, ".ParallelGroupRanks")],
    "ParallelGroupMap": [
        ("parallel_group_item", 1, _REP, ".ParallelGroupItem"),
        ("ckpt_restore_rank_list", 2, _REQ, ".ParallelGroupRanks"),
    ],
    "ParallelStrategyMap": [
        ("current_stage", 1, _REQ, "uint32"),
        ("parallel_strategy_item", 2, _REP, ".ParallelStrategyItem"),
        ("parallel_layout_item", 3, _REP, ".ParallelLayoutItem"),
    ],
}

CHECKPOINT_MESSAGES: dict[str, list[tuple[str, int, int, str]]] = {
    "TensorProto": [("dims", 1, _REP, "int64"), ("tensor_type", 2, _REQ, "string"), ("tensor_content", 3, _REQ, "bytes")],
    "MapTensorProto": [("tensor", 1, _REP, ".TensorProto")],
    "Checkpoint": [("value", 1, _REP, ".Checkpoint.Value")],
    "Checkpoint.Value": [
        ("tag", 1, _REQ, "string"),
        ("tensor", 2, _OPT, ".TensorProto"),
        ("maptensor", 3, _OPT, ".MapTensorProto"),
    ],
}


def _build(file_name: str, package: str, messages, oneofs=None):
    fdp = descriptor_pb2.FileDescriptorProto(name=file_name, package=package, syntax="proto2")
    prefix = f".{package}" if package else ""
    built: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full, fields in messages.items():
        parts = full.split(".")
        if len(parts) == 1:
            msg = fdp.message_type.add(name=parts[0])
        else:
            msg = built[parts[0]].nested_type.add(name=parts[1])
        built[full] = msg
        for fname, number, label, ftype in fields:
            f = msg.field.add(name=fname, number=number, label=label)
            if ftype.startswith("."):
                f.type = _F.TYPE_MESSAGE
                f.type_name = prefix + ftype
            else:
                f.type = _TYPES[ftype]
    for msg_name, (oneof_name, field_names) in (oneofs or {}).items():
        msg = built[msg_name]
        idx = len(msg.oneof_decl)
        msg.oneof_decl.add(name=oneof_name)
        for f in msg.field:
            if f.name in field_names:
                f.oneof_index = idx
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    classes = {}
    for full in messages:
        desc = pool.FindMessageTypeByName(f"{package}.{full}" if package else full)
        classes[full] = message_factory.GetMessageClass(desc)
    return classes


_strategy = _build("reshard_job_node_strategy.proto", "mindspore.straspb", STRATEGY_MESSAGES)
_checkpoint = _build(
    "reshard_job_checkpoint.proto", "", CHECKPOINT_MESSAGES,
    oneofs={"Checkpoint.Value": ("value", {"tensor", "maptensor"})},
)

ParallelStrategyMap = _strategy["ParallelStrategyMap"]
ParallelLayouts = _strategy["ParallelLayouts"]
ParallelGroupMap = _strategy["ParallelGroupMap"]
Checkpoint = _checkpoint["Checkpoint"]
TensorProto = _checkpoint["TensorProto"]
