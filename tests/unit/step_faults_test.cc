// FP8RT_FAULT's parser (runtime/worker/step_faults.h): the forms of trainer.h give their fields,
// anything else is refused naming the variable and the forms, and slow_register's delay.
#include "runtime/worker/step_faults.h"

#include <chrono>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fp8rt::worker {
namespace {

using ::testing::HasSubstr;
using Kind = FaultSpec::Kind;

TEST(FaultSpecTest, TheFormsGiveTheirFields) {
  absl::StatusOr<FaultSpec> f = FaultSpec::Parse("");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind, Kind::kNone);

  f = FaultSpec::Parse("hang:rank=1:step=6");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind, Kind::kHang);
  EXPECT_EQ(f->rank, 1);
  EXPECT_EQ(f->step, 6);

  f = FaultSpec::Parse("inf_act:rank=0:step=2:block=3");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind, Kind::kInfAct);
  EXPECT_EQ(f->block, 3);

  f = FaultSpec::Parse("outlier_act:rank=0:step=4:layer=blocks.0.mlp.fc2:growth=3:steps=7");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind, Kind::kOutlierAct);
  EXPECT_EQ(f->layer, "blocks.0.mlp.fc2");
  EXPECT_EQ(f->growth, 3);
  EXPECT_EQ(f->grow_steps, 7);

  f = FaultSpec::Parse("slow_register:rank=1:ms=7500");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->kind, Kind::kSlowRegister);
  EXPECT_EQ(f->rank, 1);
  EXPECT_EQ(f->delay_ms, 7500);
  f = FaultSpec::Parse("slow_register:rank=0:ms=600000");  // the longest delay taken
  ASSERT_TRUE(f.ok()) << f.status();
}

TEST(FaultSpecTest, MalformedValuesAreRefusedNamingTheVariableAndTheForms) {
  for (const char* text : {
           "slow_register:rank=1",                // no delay
           "slow_register:ms=100",                // no rank
           "slow_register:rank=1:ms=100:step=2",  // slow_register takes no step
           "slow_register:rank=1:ms=600001",      // longer than ten minutes
           "slow_register:rank=1:ms=-5",
           "slow_register:rank=1:ms=1:ms=2",  // a key twice
           "kill:rank=1:ms=100",              // ms belongs to slow_register only
           "kill:rank=1",                     // no step
           "kill:rank=1:step=0",              // steps count from 1
           "nan_grad:rank=0:step=2:block=1",  // block belongs to the activation faults
           "outlier_act:rank=0:step=2",       // no layer
           "explode:rank=0:step=2",
       }) {
    const absl::StatusOr<FaultSpec> f = FaultSpec::Parse(text);
    ASSERT_FALSE(f.ok()) << text;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(f.status().message(), HasSubstr(std::string("FP8RT_FAULT='") + text + "'"));
    EXPECT_THAT(f.status().message(), HasSubstr("slow_register:rank=R:ms=M")) << text;
  }
}

// BeforeRegister waits only on the fault's rank, for the fault's delay.
TEST(StepFaultsTest, SlowRegisterWaitsOnItsRankOnly) {
  absl::StatusOr<FaultSpec> f = FaultSpec::Parse("slow_register:rank=1:ms=300");
  ASSERT_TRUE(f.ok()) << f.status();
  using Clock = std::chrono::steady_clock;
  for (int rank : {0, 1}) {
    const StepFaults faults(*f, rank, /*resumed=*/false);
    const Clock::time_point t0 = Clock::now();
    faults.BeforeRegister();
    const auto waited = Clock::now() - t0;
    if (rank == 1) {
      EXPECT_GE(waited, std::chrono::milliseconds(300));
    } else {
      EXPECT_LT(waited, std::chrono::milliseconds(300));
    }
  }
}

}  // namespace
}  // namespace fp8rt::worker
