/*!
 * \file instruction_kind.cc
 * \brief Creation, caching and inspection of TVM instruction kinds through tvm-ffi only.
 *
 * Global functions (all under "tvm_cascade.core."):
 *   InstructionKindTypeIndex() -> int
 *   RegisterInstructionKind(name, method, input_names, attr_names, is_pure, single_output)
 *       -> InstructionKind
 *   GetInstructionKind(name) -> InstructionKind
 *   HasInstructionKind(name) -> bool
 *   ListInstructionKinds() -> Array<String>
 *   InspectInstructionKind(kind) -> Map<String, Any>
 *   GetInstructionKindFunctor(kind, which) -> Optional<Function>
 */
#include "instruction_kind.h"

#include <tvm/ffi/c_api.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/memory.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/reflection/registry.h>

#include <atomic>
#include <iomanip>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace tvm_cascade {

/*! \brief Name of the Python-registered dispatcher that applies cascade instructions. */
constexpr const char* kApplyInstructionFunc = "tvm_cascade.apply_instruction";

int32_t InstructionKindMirrorNode::RuntimeTypeIndex() {
  // Looked up until it succeeds once, then cached.
  static std::atomic<int32_t> cached{-1};
  int32_t index = cached.load(std::memory_order_acquire);
  if (index >= 0) return index;
  std::string key(kInstructionKindTypeKey);
  TVMFFIByteArray key_arr{key.data(), key.size()};
  int32_t out = -1;
  int rc = TVMFFITypeKeyToIndex(&key_arr, &out);
  if (rc != 0) {
    // Drop the error raised by the lookup; a clearer one is thrown below.
    TVMFFIObjectHandle err = nullptr;
    TVMFFIErrorMoveFromRaised(&err);
    if (err != nullptr) TVMFFIObjectDecRef(err);
  }
  if (rc != 0 || out < 0) {
    TVM_FFI_THROW(RuntimeError)
        << "The type \"" << kInstructionKindTypeKey
        << "\" is not registered; import tvm (tvm.s_tir) before using tvm_cascade's core";
  }
  cached.store(out, std::memory_order_release);
  return out;
}

const InstructionKindMirrorNode* AsInstructionKind(const ffi::ObjectRef& obj) {
  if (!obj.defined()) {
    TVM_FFI_THROW(TypeError) << "Expected an InstructionKind, but got None";
  }
  int32_t expected = InstructionKindMirrorNode::RuntimeTypeIndex();
  if (obj->type_index() != expected) {
    TVM_FFI_THROW(TypeError) << "Expected an object of type \"" << kInstructionKindTypeKey
                             << "\", but got \"" << obj->GetTypeKey() << "\"";
  }
  return static_cast<const InstructionKindMirrorNode*>(obj.get());
}

namespace {

/*! \brief Everything needed to build the functors of one cascade instruction kind. */
struct KindSpec {
  std::string name;
  std::string method;
  std::vector<std::string> input_names;
  std::vector<std::string> attr_names;
  bool is_pure{false};
  bool single_output{false};

  bool operator==(const KindSpec& other) const {
    return name == other.name && method == other.method && input_names == other.input_names &&
           attr_names == other.attr_names && is_pure == other.is_pure &&
           single_output == other.single_output;
  }
};

/*! \brief Render one (already name-translated) argument as Python source. */
void PrintPythonValue(const Any& value, std::ostream& os) {
  switch (value.type_index()) {
    case ffi::TypeIndex::kTVMFFINone:
      os << "None";
      return;
    case ffi::TypeIndex::kTVMFFIBool:
      os << (value.cast<bool>() ? "True" : "False");
      return;
    case ffi::TypeIndex::kTVMFFIInt:
      os << value.cast<int64_t>();
      return;
    case ffi::TypeIndex::kTVMFFIFloat: {
      std::ostringstream tmp;
      tmp << std::setprecision(17) << value.cast<double>();
      os << tmp.str();
      return;
    }
    default:
      break;
  }
  if (auto opt_str = value.as<ffi::String>()) {
    // TVM already turned RVs into names and quoted string literals.
    os << std::string(opt_str.value());
    return;
  }
  if (auto opt_arr = value.as<ffi::Array<Any>>()) {
    os << '[';
    bool first = true;
    for (const Any& elem : opt_arr.value()) {
      if (!first) os << ", ";
      first = false;
      PrintPythonValue(elem, os);
    }
    os << ']';
    return;
  }
  // Anything else (IntImm, maps, ...): rely on the generic ffi printer.
  static ffi::Function repr = ffi::Function::GetGlobalRequired("ffi.ReprPrint");
  os << std::string(repr(value).cast<ffi::String>());
}

FInstructionApply MakeApply(const std::string& name) {
  return FInstructionApply(
      [name](ffi::ObjectRef sch, const ffi::Array<Any>& inputs, const ffi::Array<Any>& attrs,
             const Any& decision) -> ffi::Array<Any> {
        std::optional<ffi::Function> f = ffi::Function::GetGlobal(kApplyInstructionFunc);
        if (!f.has_value()) {
          TVM_FFI_THROW(RuntimeError)
              << "Cannot apply instruction \"" << name << "\": the global function \""
              << kApplyInstructionFunc
              << "\" is not registered (import tvm_cascade.trace to register it)";
        }
        Any result = (*f)(ffi::String(name), sch, inputs, attrs, decision);
        if (result == nullptr) return ffi::Array<Any>();
        return result.cast<ffi::Array<Any>>();
      });
}

FInstructionAsPython MakeAsPython(const KindSpec& spec) {
  return FInstructionAsPython([spec](const ffi::Array<Any>& inputs, const ffi::Array<Any>& attrs,
                                     const Any& decision,
                                     const ffi::Array<ffi::String>& outputs) -> ffi::String {
    if (inputs.size() != spec.input_names.size()) {
      TVM_FFI_THROW(ValueError) << "Instruction \"" << spec.name << "\" expects "
                                << spec.input_names.size() << " inputs, but got "
                                << inputs.size();
    }
    if (attrs.size() != spec.attr_names.size()) {
      TVM_FFI_THROW(ValueError) << "Instruction \"" << spec.name << "\" expects "
                                << spec.attr_names.size() << " attrs, but got " << attrs.size();
    }
    std::ostringstream os;
    if (!outputs.empty()) {
      if (spec.single_output) {
        if (outputs.size() != 1) {
          TVM_FFI_THROW(ValueError) << "Instruction \"" << spec.name
                                    << "\" has a single output, but got " << outputs.size();
        }
        os << std::string(outputs[0]);
      } else if (outputs.size() == 1) {
        os << std::string(outputs[0]) << ',';
      } else {
        for (size_t i = 0; i < outputs.size(); ++i) {
          if (i) os << ", ";
          os << std::string(outputs[i]);
        }
      }
      os << " = ";
    }
    os << "sch." << spec.method << '(';
    bool first = true;
    auto emit = [&](const std::string& key, const Any& value) {
      if (!first) os << ", ";
      first = false;
      os << key << '=';
      PrintPythonValue(value, os);
    };
    for (size_t i = 0; i < inputs.size(); ++i) emit(spec.input_names[i], inputs[i]);
    for (size_t i = 0; i < attrs.size(); ++i) emit(spec.attr_names[i], attrs[i]);
    if (decision != nullptr) emit("decision", decision);
    os << ')';
    return ffi::String(os.str());
  });
}

ffi::ObjectRef CreateKind(const KindSpec& spec) {
  ffi::ObjectPtr<InstructionKindMirrorNode> n = ffi::make_object<InstructionKindMirrorNode>();
  n->name = ffi::String(spec.name);
  n->is_pure = spec.is_pure;
  n->f_apply_to_schedule = MakeApply(spec.name);
  n->f_as_python = MakeAsPython(spec);
  // f_attrs_as_json / f_attrs_from_json stay null: cascade attrs are plain JSON-able values,
  // and TVM treats a null functor as the identity conversion.
  return ffi::ObjectRef(std::move(n));
}

/*! \brief Process-wide table of cascade kinds; objects are created lazily and cached. */
class KindRegistry {
 public:
  static KindRegistry* Global() {
    // Leaked on purpose: kinds may be referenced by traces alive at interpreter shutdown.
    static KindRegistry* inst = new KindRegistry();
    return inst;
  }

  void AddSpec(KindSpec spec) {
    std::lock_guard<std::mutex> lock(mutex_);
    AddSpecLocked(std::move(spec));
  }

  ffi::ObjectRef Register(KindSpec spec) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string name = spec.name;
    AddSpecLocked(std::move(spec));
    return GetLocked(name);
  }

  ffi::ObjectRef Get(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    return GetLocked(name);
  }

  bool Has(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.count(name) != 0;
  }

  ffi::Array<ffi::String> List() {
    std::lock_guard<std::mutex> lock(mutex_);
    ffi::Array<ffi::String> names;
    for (const auto& kv : entries_) names.push_back(ffi::String(kv.first));
    return names;
  }

 private:
  struct Entry {
    KindSpec spec;
    ffi::ObjectRef kind;  // null until first use
  };

  void AddSpecLocked(KindSpec spec) {
    if (spec.name.empty()) TVM_FFI_THROW(ValueError) << "Instruction kind name must be non-empty";
    if (spec.method.empty()) TVM_FFI_THROW(ValueError) << "Schedule method name must be non-empty";
    auto it = entries_.find(spec.name);
    if (it != entries_.end()) {
      if (!(it->second.spec == spec)) {
        TVM_FFI_THROW(ValueError) << "Instruction kind \"" << spec.name
                                  << "\" is already registered with a different definition";
      }
      return;
    }
    std::string name = spec.name;
    entries_.emplace(std::move(name), Entry{std::move(spec), ffi::ObjectRef(nullptr)});
  }

  ffi::ObjectRef GetLocked(const std::string& name) {
    auto it = entries_.find(name);
    if (it == entries_.end()) {
      TVM_FFI_THROW(KeyError) << "Unknown cascade instruction kind: \"" << name << "\"";
    }
    if (!it->second.kind.defined()) it->second.kind = CreateKind(it->second.spec);
    return it->second.kind;
  }

  std::mutex mutex_;
  std::map<std::string, Entry> entries_;
};

std::vector<std::string> ToStdStrings(const ffi::Array<ffi::String>& arr) {
  std::vector<std::string> out;
  out.reserve(arr.size());
  for (const ffi::String& s : arr) out.emplace_back(std::string(s));
  return out;
}

ffi::Map<ffi::String, Any> Inspect(const ffi::ObjectRef& obj) {
  const InstructionKindMirrorNode* kind = AsInstructionKind(obj);
  ffi::Map<ffi::String, Any> info;
  info.Set("type_key", ffi::String(obj->GetTypeKey()));
  info.Set("type_index", static_cast<int64_t>(obj->type_index()));
  info.Set("name", kind->name);
  info.Set("is_pure", kind->is_pure);
  info.Set("has_apply_to_schedule", kind->f_apply_to_schedule != nullptr);
  info.Set("has_as_python", kind->f_as_python != nullptr);
  info.Set("has_attrs_as_json", kind->f_attrs_as_json != nullptr);
  info.Set("has_attrs_from_json", kind->f_attrs_from_json != nullptr);
  return info;
}

ffi::Optional<ffi::Function> GetFunctor(const ffi::ObjectRef& obj, const std::string& which) {
  const InstructionKindMirrorNode* kind = AsInstructionKind(obj);
  const ffi::Function* f = nullptr;
  if (which == "apply_to_schedule") {
    f = &kind->f_apply_to_schedule.packed();
  } else if (which == "as_python") {
    f = &kind->f_as_python.packed();
  } else if (which == "attrs_as_json") {
    f = &kind->f_attrs_as_json.packed();
  } else if (which == "attrs_from_json") {
    f = &kind->f_attrs_from_json.packed();
  } else {
    TVM_FFI_THROW(ValueError) << "Unknown functor \"" << which
                              << "\"; expected one of apply_to_schedule, as_python, "
                                 "attrs_as_json, attrs_from_json";
  }
  if (*f == nullptr) return std::nullopt;
  return *f;
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  // Built-in cascade kinds. Their objects are created on first use, after TVM is loaded.
  KindRegistry::Global()->AddSpec(
      KindSpec{"RollingUpdate", "rolling_update", {"block", "loop"}, {}, false, false});
  KindRegistry::Global()->AddSpec(
      KindSpec{"SplitKUpdate", "split_k_update", {"block", "loop"}, {}, false, false});
  KindRegistry::Global()->AddSpec(
      KindSpec{"HoistIndependent", "hoist_independent", {"block"}, {}, false, false});

  namespace refl = ::tvm::ffi::reflection;
  refl::GlobalDef()
      .def("tvm_cascade.core.InstructionKindTypeIndex",
           []() -> int64_t { return InstructionKindMirrorNode::RuntimeTypeIndex(); })
      .def("tvm_cascade.core.RegisterInstructionKind",
           [](ffi::String name, ffi::String method, ffi::Array<ffi::String> input_names,
              ffi::Array<ffi::String> attr_names, bool is_pure,
              bool single_output) -> ffi::ObjectRef {
             return KindRegistry::Global()->Register(KindSpec{
                 std::string(name), std::string(method), ToStdStrings(input_names),
                 ToStdStrings(attr_names), is_pure, single_output});
           })
      .def("tvm_cascade.core.GetInstructionKind",
           [](ffi::String name) -> ffi::ObjectRef {
             return KindRegistry::Global()->Get(std::string(name));
           })
      .def("tvm_cascade.core.HasInstructionKind",
           [](ffi::String name) -> bool { return KindRegistry::Global()->Has(std::string(name)); })
      .def("tvm_cascade.core.ListInstructionKinds",
           []() -> ffi::Array<ffi::String> { return KindRegistry::Global()->List(); })
      .def("tvm_cascade.core.InspectInstructionKind", Inspect)
      .def("tvm_cascade.core.GetInstructionKindFunctor",
           [](ffi::ObjectRef kind, ffi::String which) -> ffi::Optional<ffi::Function> {
             return GetFunctor(kind, std::string(which));
           });
}

}  // namespace tvm_cascade
