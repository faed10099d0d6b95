// The lines `fp8rt launch` prints for the controller's events
// (launcher/launch/controller_events.h): one per event a user acts on, naming the step, the kind in
// words and the controller's message; none for the bookkeeping kinds.
#include "launcher/launch/controller_events.h"

#include <string>

#include "gtest/gtest.h"

namespace fp8rt::launch {
namespace {

v1::Event Make(const std::string& kind, int64_t step, const std::string& message) {
  v1::Event e;
  e.set_id(7);
  e.set_run_id("r");
  e.set_kind(kind);
  e.set_step(step);
  e.set_message(message);
  return e;
}

TEST(ControllerEventsTest, EveryKindAUserActsOnIsALine) {
  struct Case {
    const char* kind;
    const char* words;
  };
  for (const Case& c :
       {Case{"checkpoint_committed", "checkpoint committed"},
        Case{"checkpoint_refused", "checkpoint refused"},
        Case{"checkpoint_failed", "checkpoint failed"},
        Case{"resume_resharded", "resumed at another layout"},
        Case{"recipe_applied", "recipe applied"}, Case{"layer_demoted", "health policy"},
        Case{"layer_recipe_changed", "health policy"}, Case{"layer_promoted", "health policy"},
        Case{"health_action_failed", "health policy"},
        Case{"step_skipped", "step skipped"}, Case{"worker_lost", "worker lost"},
        Case{"run_finished", "run finished"}, Case{"run_failed", "run failed"},
        Case{"run_stopped", "run stopped"}}) {
    SCOPED_TRACE(c.kind);
    const std::optional<std::string> line = EventLine(Make(c.kind, 42, "the message"));
    ASSERT_TRUE(line.has_value());
    EXPECT_EQ(*line, std::string("controller: step 42: ") + c.words + ": the message");
  }
}

TEST(ControllerEventsTest, BookkeepingKindsAreNotShown) {
  for (const char* kind :
       {"run_registered", "recipe_updated", "checkpoint_requested", "fp8_health", "unknown"}) {
    EXPECT_FALSE(EventLine(Make(kind, 1, "m")).has_value()) << kind;
  }
}

TEST(ControllerEventsTest, OnlyTheEndsOfARunEndTheWait) {
  EXPECT_TRUE(IsEndEvent(Make("run_finished", 1, "")));
  EXPECT_TRUE(IsEndEvent(Make("run_failed", 1, "")));
  EXPECT_TRUE(IsEndEvent(Make("run_stopped", 1, "")));
  EXPECT_FALSE(IsEndEvent(Make("worker_lost", 1, "")));
  EXPECT_FALSE(IsEndEvent(Make("checkpoint_committed", 1, "")));
}

}  // namespace
}  // namespace fp8rt::launch
