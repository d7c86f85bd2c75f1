/*!
 * \file schedule_state.cc
 * \brief Refreshing the cached block flags of a TVM ``s_tir::ScheduleState``.
 *
 * Python can rewrite a schedule's IR with ``ScheduleState.replace``, but TVM gives blocks
 * created that way all-false cached flags (affine binding, region cover, stage pipeline)
 * and keeps reused blocks' flags as they were; only TVM's own primitives call the
 * unexported ``UpdateScopeSBlockInfo``. Wrong flags make later primitives refuse valid
 * IR. This file reads the state through a layout mirror of TVM's classes:
 *
 *   StmtSRefNode:      Object header; const StmtNode* stmt; StmtSRefNode* parent;
 *                      int64_t seq_index;
 *   SBlockInfo:        SBlockScope scope; bool affine_binding, region_cover, stage_pipeline;
 *   ScheduleStateNode: Object header; IRModule mod;
 *                      unordered_map<StmtSRef, SBlockInfo, ObjectPtrHash, ObjectPtrEqual>;
 *                      unordered_map<const StmtNode*, StmtSRef> stmt2ref;
 *                      int debug_mask; bool enable_check;
 *
 * and copies into it the flags of a freshly built ScheduleState of the same module, which
 * is exactly what TVM's own debug verification compares the cached flags against.
 */
#include <tvm/ffi/any.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/object.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdint>
#include <string>
#include <unordered_map>

namespace tvm_cascade {
namespace {

namespace ffi = ::tvm::ffi;

struct StmtSRefMirror : public ffi::Object {
  const ffi::Object* stmt;
  StmtSRefMirror* parent;
  int64_t seq_index;
};

struct SBlockInfoMirror {
  ffi::ObjectRef scope;
  bool affine_binding{false};
  bool region_cover{false};
  bool stage_pipeline{false};
};

struct ScheduleStateMirror : public ffi::Object {
  ffi::ObjectRef mod;
  std::unordered_map<ffi::ObjectRef, SBlockInfoMirror, ffi::ObjectPtrHash, ffi::ObjectPtrEqual>
      block_info;
  std::unordered_map<const ffi::Object*, ffi::ObjectRef> stmt2ref;
  int debug_mask;
  bool enable_check;
};

int32_t TypeIndexOf(const char* key) {
  TVMFFIByteArray bytes{key, std::char_traits<char>::length(key)};
  int32_t index = -1;
  if (TVMFFITypeKeyToIndex(&bytes, &index) != 0) {
    TVM_FFI_THROW(RuntimeError) << "type " << key << " is not registered: is TVM loaded?";
  }
  return index;
}

ScheduleStateMirror* AsState(const ffi::ObjectRef& state) {
  if (!state.defined() || state->type_index() != TypeIndexOf("s_tir.ScheduleState")) {
    TVM_FFI_THROW(TypeError) << "expected an s_tir.ScheduleState";
  }
  return const_cast<ScheduleStateMirror*>(static_cast<const ScheduleStateMirror*>(state.get()));
}

/*! \brief Copy the flags TVM computes from scratch into ``state``; returns blocks updated. */
int64_t RefreshSBlockFlags(ffi::ObjectRef state_ref) {
  ScheduleStateMirror* state = AsState(state_ref);
  static const ffi::Function make_state = ffi::Function::GetGlobalRequired("s_tir.schedule.ScheduleState");
  ffi::ObjectRef fresh_ref = make_state(state->mod, 0, true).cast<ffi::ObjectRef>();
  const ScheduleStateMirror* fresh = AsState(fresh_ref);
  int64_t updated = 0;
  for (const auto& [fresh_sref, fresh_info] : fresh->block_info) {
    const auto* sref = static_cast<const StmtSRefMirror*>(fresh_sref.get());
    auto it = state->stmt2ref.find(sref->stmt);
    if (it == state->stmt2ref.end()) {
      TVM_FFI_THROW(InternalError) << "a block of the module has no sref in the schedule state";
    }
    auto info = state->block_info.find(it->second);
    if (info == state->block_info.end()) {
      TVM_FFI_THROW(InternalError) << "a block sref of the schedule state has no block info";
    }
    info->second.affine_binding = fresh_info.affine_binding;
    info->second.region_cover = fresh_info.region_cover;
    info->second.stage_pipeline = fresh_info.stage_pipeline;
    ++updated;
  }
  return updated;
}

/*! \brief What the mirror reads: [debug_mask, enable_check, #block_info, #stmt2ref]. */
ffi::Array<int64_t> InspectScheduleState(ffi::ObjectRef state_ref) {
  const ScheduleStateMirror* state = AsState(state_ref);
  return {state->debug_mask, state->enable_check ? 1 : 0,
          static_cast<int64_t>(state->block_info.size()),
          static_cast<int64_t>(state->stmt2ref.size())};
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = ::tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_cascade.core.RefreshSBlockFlags", RefreshSBlockFlags)
      .def("tvm_cascade.core.InspectScheduleState", InspectScheduleState);
}

}  // namespace tvm_cascade
