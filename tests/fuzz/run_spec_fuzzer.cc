// Fuzz target: run-spec loading and validation (runtime/spec/run_spec.h, ParseRunSpec and
// ValidateRunSpec).
//
// The input is YAML text, optionally followed by a line "#--set" (a YAML comment, so every seed
// is still a valid spec file) and override lines "dotted.path=value", one a line, as
// `--set` gives them. A spec that loads is then validated for world size 0 (no layout check) and
// for dp x tp. Every error must be InvalidArgument with a non-empty message (run_spec.h), and
// nothing may escape as an exception (the YAML library throws; the loader must catch).
//
// Validation opens data.path. So that no input makes the fuzzer open an arbitrary path (a FIFO
// would block it, a device file may act on open), a non-empty data.path is replaced by a file
// of the harness's own before validating; the path checks themselves are unit-tested.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "runtime/spec/run_spec.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

constexpr std::string_view kOverridesMarker = "\n#--set\n";
constexpr size_t kMaxOverrides = 16;

void CheckError(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  FUZZ_CHECK(absl::IsInvalidArgument(s), "%s: not InvalidArgument: %s", what, s.ToString().c_str());
  FUZZ_CHECK(!s.message().empty(), "%s: empty error message", what);
}

// An empty regular file that exists while the fuzzer runs (removed at exit).
const std::string& DataFile() {
  static const std::string path = [] {
    std::error_code ec;
    std::string dir = std::filesystem::temp_directory_path(ec).string();
    if (ec) dir = "/tmp";
    std::string name = dir + "/fp8rt-fuzz-run-spec-XXXXXX";
    const int fd = ::mkstemp(name.data());
    FUZZ_CHECK(fd >= 0, "mkstemp %s", name.c_str());
    ::close(fd);
    return name;
  }();
  static const int registered = std::atexit([] { ::unlink(path.c_str()); });
  (void)registered;
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fp8rt;
  std::string yaml(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> overrides;
  if (const size_t cut = yaml.find(kOverridesMarker); cut != std::string::npos) {
    std::string_view rest = std::string_view(yaml).substr(cut + kOverridesMarker.size());
    while (!rest.empty() && overrides.size() < kMaxOverrides) {
      const size_t end = rest.find('\n');
      overrides.emplace_back(rest.substr(0, end));
      rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    }
    yaml.resize(cut + 1);
  }
  absl::StatusOr<v1::RunSpec> spec = ParseRunSpec(yaml, "fuzz.yaml", overrides);
  if (!spec.ok()) {
    CheckError(spec.status(), "ParseRunSpec");
    return 0;
  }
  if (!spec->data().path().empty()) spec->mutable_data()->set_path(DataFile());
  CheckError(ValidateRunSpec(*spec, 0), "ValidateRunSpec(world 0)");
  const int64_t world = static_cast<int64_t>(spec->parallel().dp()) * spec->parallel().tp();
  if (world >= 1 && world <= std::numeric_limits<int>::max()) {
    CheckError(ValidateRunSpec(*spec, static_cast<int>(world)), "ValidateRunSpec(dp x tp)");
  }
  return 0;
}
