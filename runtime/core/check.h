// FP8RT_CHECK(cond) << "message": aborts with file:line and the message when an invariant is
// violated. For programming errors only; bad input gets an absl::Status instead.
#ifndef FP8RT_RUNTIME_CORE_CHECK_H_
#define FP8RT_RUNTIME_CORE_CHECK_H_

#include <sstream>

namespace fp8rt::internal {

// Collects the message and aborts in its destructor.
class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition);
  [[noreturn]] ~CheckFailure();
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

// Lets `cond ? (void)0 : Voidify() & stream << msg` type-check.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace fp8rt::internal

#define FP8RT_CHECK(cond)                 \
  (cond) ? (void)0                        \
         : ::fp8rt::internal::Voidify() & \
               ::fp8rt::internal::CheckFailure(__FILE__, __LINE__, #cond).stream()

#endif  // FP8RT_RUNTIME_CORE_CHECK_H_
