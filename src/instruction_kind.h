/*!
 * \file instruction_kind.h
 * \brief A mirror of TVM's ``s_tir::InstructionKindNode`` built only on tvm-ffi.
 *
 * The apache-tvm wheel exports no C++ compiler symbols, so the cascade core cannot
 * link against ``tvm::s_tir::InstructionKind``.  It can, however, create and read
 * objects of that type: an ffi object is a header (type index, ref counts, deleter)
 * followed by its fields, and TVM's ``InstructionKindNode`` is
 *
 *   ffi::Object header; ffi::String name; bool is_pure;
 *   TypedFunction f_apply_to_schedule, f_as_python, f_attrs_as_json, f_attrs_from_json;
 *
 * Every ``TypedFunction`` holds exactly one ``ffi::Function`` (one object pointer), so
 * the struct below has the same layout.  Objects are allocated with the runtime type
 * index TVM registered for "s_tir.InstructionKind" (looked up, never allocated), so TVM
 * and Python treat them as genuine instruction kinds.  Because the deleter is stored
 * in each object's header, TVM frees our objects with our deleter.
 */
#ifndef TVM_CASCADE_INSTRUCTION_KIND_H_
#define TVM_CASCADE_INSTRUCTION_KIND_H_

#include <tvm/ffi/any.h>
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/object.h>
#include <tvm/ffi/string.h>

#include <cstdint>

namespace tvm_cascade {

namespace ffi = ::tvm::ffi;
using ffi::Any;

/*! \brief Signature of TVM's FInstructionApply with Schedule erased to ObjectRef. */
using FInstructionApply = ffi::TypedFunction<ffi::Array<Any>(
    ffi::ObjectRef sch, const ffi::Array<Any>& inputs, const ffi::Array<Any>& attrs,
    const Any& decision)>;
/*! \brief Signature of TVM's FInstructionAsPython. */
using FInstructionAsPython = ffi::TypedFunction<ffi::String(
    const ffi::Array<Any>& inputs, const ffi::Array<Any>& attrs, const Any& decision,
    const ffi::Array<ffi::String>& outputs)>;
/*! \brief Signature of TVM's FInstructionAttrsAsJSON. */
using FInstructionAttrsAsJSON = ffi::TypedFunction<ffi::ObjectRef(ffi::Array<Any> attrs)>;
/*! \brief Signature of TVM's FInstructionAttrsFromJSON. */
using FInstructionAttrsFromJSON = ffi::TypedFunction<ffi::Array<Any>(ffi::ObjectRef json_attrs)>;

/*! \brief Type key TVM registers for InstructionKindNode. */
inline constexpr const char* kInstructionKindTypeKey = "s_tir.InstructionKind";

/*!
 * \brief Layout mirror of tvm::s_tir::InstructionKindNode.
 *
 * The type-info members are spelled out by hand (no TVM_FFI_DECLARE_OBJECT_INFO macro)
 * so that loading this library never allocates a type index: RuntimeTypeIndex() only
 * looks up the index TVM already registered and fails loudly if TVM is not loaded.
 */
class InstructionKindMirrorNode : public ffi::Object {
 public:
  ffi::String name;
  bool is_pure{false};
  FInstructionApply f_apply_to_schedule{nullptr};
  FInstructionAsPython f_as_python{nullptr};
  FInstructionAttrsAsJSON f_attrs_as_json{nullptr};
  FInstructionAttrsFromJSON f_attrs_from_json{nullptr};

  static constexpr const char* _type_key = kInstructionKindTypeKey;
  static constexpr bool _type_final = true;
  static constexpr uint32_t _type_child_slots = 0;
  static constexpr int32_t _type_depth = 1;
  /*!
   * \brief The runtime type index of "s_tir.InstructionKind" as registered by TVM.
   * \throws ffi::Error (RuntimeError) when TVM's library has not registered the type.
   */
  static int32_t RuntimeTypeIndex();
};

// Layout guards: every functor must be a single object pointer, as in TVM.
static_assert(sizeof(FInstructionApply) == sizeof(void*), "TypedFunction layout changed");
static_assert(sizeof(FInstructionAsPython) == sizeof(ffi::Function), "TypedFunction layout");

/*!
 * \brief View an arbitrary object as an instruction kind, checking its runtime type.
 * \throws TypeError if obj is null or not an "s_tir.InstructionKind".
 */
const InstructionKindMirrorNode* AsInstructionKind(const ffi::ObjectRef& obj);

}  // namespace tvm_cascade

#endif  // TVM_CASCADE_INSTRUCTION_KIND_H_
